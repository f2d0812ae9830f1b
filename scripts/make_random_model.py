"""Writes a Qwen3-architecture checkpoint with random weights in a real model's shape, for GPU runs where no
model can be downloaded. The tokenizer (and so the vocabulary) is copied from an existing model folder.

Usage: python scripts/make_random_model.py --shape qwen3-0.6b --tokenizer-from <model dir> --out <dir>
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

SHAPES = {  # hidden, layers, heads, kv heads, head dim, intermediate (from the published Qwen3 configs)
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    hidden, layers, heads, kv_heads, head_dim, intermediate = SHAPES[args.shape]
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        max_position_embeddings=40960, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {args.out}")


if __name__ == "__main__":
    main()
