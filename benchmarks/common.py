"""What the benchmarks share: CUDA-graph replay timing with inputs rotated past the L2, a clock warm-up and the
device's copy bandwidth (the rooflines' denominator); Qwen3-architecture models with random weights in real
models' shapes (no model can be downloaded on the GPU machine), in memory or written to disk with a tokenizer
copied from an existing model folder.

The benchmarks measure on CUDA. Without a CUDA device they run as smoke runs (``tests/benchmarks/test_benchmarks_smoke.py``):
on :data:`DEVICE` "cpu", at the tiny sizes their options or ``--smoke`` give, Triton kernels through the Triton
interpreter (``TRITON_INTERPRET=1``, :func:`require_kernels`), timed by the wall clock without graphs or L2
rotation; their figures then say only that the script runs.

Training MFU (:func:`train_pass_flop`) is over :data:`H200_BF16_TFLOPS`, the H200's dense bf16 matrix peak, unless a
benchmark's ``--peak-tflops`` says otherwise.

``python -m benchmarks.common --shape qwen3-0.6b --tokenizer-from <model dir> --out <dir>`` writes such a
checkpoint (the vocabulary is the tokenizer's unless ``--vocab-size`` says otherwise).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.lora.layers import AdapterWeights

DT = torch.bfloat16  # the benchmarks' dtype
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # "cpu": a smoke run (module docstring)
# An H200's L2 is 50 MiB: inputs rotated over 3x this miss it. The CPU's smoke runs rotate nothing (0).
L2_BYTES = 60 * 2**20 if DEVICE == "cuda" else 0


def require_kernels() -> None:
    """Exits with a one-line error (status 2) when the Triton kernels cannot run here: no CUDA device and no
    ``TRITON_INTERPRET=1`` (which must be set before Python starts)."""
    if DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        print("error: no CUDA device: run on a GPU, or set TRITON_INTERPRET=1 for a CPU smoke run at tiny sizes",
              file=sys.stderr)
        sys.exit(2)


def sync() -> None:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    """The CUDA device's name, or "cpu"."""
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"


def reset_peak_memory() -> None:
    """Starts a new peak of allocated device memory (:func:`peak_memory_gib`)."""
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float | None:
    """GiB of device memory allocated at the peak since :func:`reset_peak_memory`; None on the CPU (not measured)."""
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None


def graph_time(calls: list[Callable[[], None]], min_calls: int = 20) -> float:
    """Seconds per call: the calls (one per input set, cycled to at least ``min_calls``, fewer for slow
    calls) captured in one CUDA graph; median over replays. On the CPU: each call once untimed, then the
    median of one wall-clock run of each."""
    if DEVICE != "cuda":
        for c in calls:
            c()
        times = []
        for c in calls:
            started = time.perf_counter()
            c()
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    for c in calls:
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    n = max(len(calls), min(min_calls, math.ceil(2e-3 / est)))
    seq = [calls[i % len(calls)] for i in range(n)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in seq[: len(calls)]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in seq:
            c()
    reps = max(5, min(30, int(0.15 / (est * n))))
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / n)
    del graph
    return statistics.median(times)


def warm_up(seconds: float = 2.0) -> None:
    """Keeps the GPU busy with bf16 matrix products so its clocks are up before anything is timed (nothing on
    the CPU)."""
    if DEVICE != "cuda":
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy by a kernel (``torch.add(src, 0, out=dst)``),
    counting bytes read plus bytes written. Not ``dst.copy_(src)``: captured in a CUDA graph that becomes a
    memcpy node, which the copy engines run slower than a kernel does (RESULTS.md, Method), and kernels are what
    the rooflines compare. On the CPU a 4 MiB copy."""
    src = torch.randn(2**30 if DEVICE == "cuda" else 2**20, device=DEVICE)
    dst = torch.empty_like(src)
    t = graph_time([lambda: torch.add(src, 0.0, out=dst)], min_calls=5)
    return 2 * src.numel() * 4 / t


SHAPES = {  # hidden, layers, heads, kv heads, head dim, intermediate (from the published Qwen3 configs)
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728),
    "tiny": (64, 2, 4, 2, 16, 128),  # for the CPU's smoke runs
}
QWEN3_VOCAB = 151936
H200_BF16_TFLOPS = 790.0  # the H200's dense bf16 matrix peak, TFLOP/s (GPU.md): training MFU's denominator by default


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


def train_pass_flop(config: Any, rank: int, prompt_lens: Sequence[int], response_lens: Sequence[int],
                    groups: Sequence[object], shared_prompts: bool) -> float:
    """Model FLOP of one LoRA training pass (forward and backward, no recomputation) over rows of
    ``prompt_lens[i] + response_lens[i]`` positions on a decoder of ``config`` (a Hugging Face Qwen3-style config:
    ``hidden_size`` H, ``num_hidden_layers`` L, ``num_attention_heads`` n, ``num_key_value_heads`` k,
    ``head_dim`` d, ``intermediate_size`` I, ``vocab_size`` V) with rank-``rank`` LoRA on its seven projections:

        F = 4 * W * T + 6 * rank * S * T + 4 * V * H * R + 12 * L * n * d * A

    - ``T``: positions the decoder computes: every row's, where ``shared_prompts`` each group's prompt (rows with equal
      ``groups[i]``, as the trainer groups them in a micro-batch) once;
    - ``W = L * (H*n*d + 2*H*k*d + n*d*H + 3*H*I)``: the decoder's projection weights. They are frozen, so the
      backward computes only their input gradients: 2 FLOP per weight and position forward, 2 backward (4, not the 6
      of full fine-tuning);
    - ``S = L * sum(in + out)`` over the projections: each LoRA product ``x A^T B^T`` costs ``2 * rank * (in + out)``
      forward, as much for its input gradient and as much for A's and B's weight gradients (6x; ~1% of F at rank 16);
    - ``R``: response positions scored by the (frozen, tied) LM head, forward and input gradient: ``4 * V * H`` each;
    - ``A``: causal query-key pairs per layer: ``p * (p + 1) / 2`` per prompt computed (per row without
      ``shared_prompts``) plus ``r * p + r * (r + 1) / 2`` per row's ``r`` response positions over its ``p``-token
      prompt;
      each pair costs ``4 * n * d`` forward (``Q K^T`` and ``P V``) and twice that backward.

    Element-wise work (norms, rotary, softmax, the loss), the optimizer and padding are not counted; the first layer's
    input gradient is (a trainer with frozen embeddings skips it)."""
    hidden, layers, heads, kv_heads = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                                       config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv, inter = heads * head_dim, kv_heads * head_dim, config.intermediate_size
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    weights = layers * sum(i * o for i, o in shapes)
    lora = layers * sum(i + o for i, o in shapes)
    prompts = {}  # the prompt length of each distinct group (shared) or of each row
    positions, responses, pairs = 0, 0, 0
    for index, (p, r, group) in enumerate(zip(prompt_lens, response_lens, groups, strict=True)):
        prompts.setdefault(group if shared_prompts else index, p)
        positions += r
        responses += r
        pairs += r * p + r * (r + 1) // 2
    positions += sum(prompts.values())
    pairs += sum(p * (p + 1) // 2 for p in prompts.values())
    return float(4 * weights * positions + 6 * rank * lora * positions + 4 * config.vocab_size * hidden * responses
                 + 12 * layers * heads * head_dim * pairs)


def random_adapter(layers: dict, rank: int, seed: int) -> AdapterWeights:
    """A seeded adapter of ``rank`` for ``layers`` (path -> multi-LoRA layer): A and B ~ N(0, 0.01^2), alpha 2r."""
    generator = torch.Generator().manual_seed(seed)
    adapter = AdapterWeights(rank=rank, alpha=2.0 * rank)
    for path, layer in layers.items():
        adapter.a[path] = torch.randn(rank, layer.in_features, generator=generator) * 0.01
        adapter.b[path] = torch.randn(layer.out_features, rank, generator=generator) * 0.01
    return adapter


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--tokenizer-from", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, help="the model's vocabulary (default: the tokenizer's)")
    args = parser.parse_args(argv)
    model = write_random_model(args.shape, args.tokenizer_from, args.out, DEVICE, vocab_size=args.vocab_size,
                               seed=args.seed)
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {args.out}")


if __name__ == "__main__":
    main()
