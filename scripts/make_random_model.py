"""Qwen3-architecture models with random weights in real models' shapes, for GPU runs where no model can be
downloaded: the shapes, the in-memory model the benchmarks build, and a checkpoint written to disk with a
tokenizer copied from an existing model folder (the benchmarks import these helpers).

Usage: python scripts/make_random_model.py --shape qwen3-0.6b --tokenizer-from <model dir> --out <dir>
(the vocabulary is the tokenizer's).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

SHAPES = {  # hidden, layers, heads, kv heads, head dim, intermediate (from the published Qwen3 configs)
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728),
}
QWEN3_VOCAB = 151936


def qwen3_config(shape: str, vocab_size: int = QWEN3_VOCAB, **extra: Any) -> Qwen3Config:
    """The config of ``shape`` (a key of :data:`SHAPES`) with tied embeddings; ``extra`` adds config fields."""
    hidden, layers, heads, kv_heads, head_dim, intermediate = SHAPES[shape]
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        max_position_embeddings=40960, tie_word_embeddings=True, **extra,
    )


def build_random_model(config: Qwen3Config, device: str, seed: int = 0) -> Qwen3ForCausalLM:
    """A bf16 model of ``config`` with random weights (seeded), built directly on ``device``."""
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(torch.bfloat16)


def write_random_model(shape: str, tokenizer_dir: Path, out: Path, device: str, vocab_size: int | None = None,
                       seed: int = 0) -> Qwen3ForCausalLM:
    """Writes a random ``shape`` checkpoint and the tokenizer of ``tokenizer_dir`` to ``out``; the vocabulary is
    ``vocab_size`` or the tokenizer's. Returns the model."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = qwen3_config(shape, vocab_size or len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    model = build_random_model(config, device, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = write_random_model(args.shape, args.tokenizer_from, args.out, device, seed=args.seed)
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {args.out}")


if __name__ == "__main__":
    main()
