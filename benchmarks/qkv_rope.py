"""The q/k/v projection's LoRA with its expand fused into q/k norm + rotary, on the GPU machine (issue 3).

For Qwen3-4B's attention block (hidden 2560, 32 query and 8 key/value heads of 128, one A per slice),
rank 16, N adapters in {8, 32} and tokens in {16, 64, 256, 4096} (bf16, uniform random adapter per row),
it times from CUDA-graph replays (``common.graph_time``: median, inputs and weights rotated past
the L2), side by side in one process:

- the base GEMM ``x @ W.T`` alone (issue 3's denominator);
- the engine's block without LoRA: the base GEMM and ``qk_norm_rope``;
- today's LoRA block: ``folded_lora_linear`` (folded GEMM + expand, or base GEMM + shrink + expand where the
  fold does not pay) and ``qk_norm_rope``;
- the fused LoRA block: ``folded_qkv_rope`` (folded GEMM, or base GEMM + shrink, and one kernel that adds
  the LoRA terms, normalises and rotates).

A block's LoRA add-on is its time minus the block without LoRA; the table gives each add-on over the base
GEMM, the ratio issue 3's targets bound (decode <= 0.35x at N=8, <= 0.6x at N=32; prefill <= 0.25x / 0.45x).

    python -m benchmarks.qkv_rope --out DIR [--adapters N ...] [--tokens T ...] [--smoke]

``--smoke``: a tiny q/k/v shape (``kernels.SMOKE_SHAPES["tiny.qkv"]``, head dim 32), for a CPU run checking that
the script runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DT, copy_bandwidth, device_name, graph_time, require_kernels, warm_up
from benchmarks.kernels import Case
from skyrl_clora.kernels import fold_lora_weights, folded_lora_linear, folded_qkv_rope, qk_norm_rope

HEAD_DIMS = {"4B.qkv": 128, "tiny.qkv": 32}  # the q/k/v shapes (``kernels.Case``) and their head dims
EPS = 1e-6


def time_case(shape: str, n_adapters: int, tokens: int) -> dict[str, float]:
    """Seconds per call of the four variants (module docstring) for one (N, T) at ``shape`` (a key of
    :data:`HEAD_DIMS`)."""
    head_dim = HEAD_DIMS[shape]
    case = Case(shape, n_adapters, tokens, 16)
    meta = case.meta
    width = sum(case.widths)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    angles = torch.rand(tokens, head_dim, device=DEVICE, generator=gen) * 6.28
    cos, sin = angles.cos().to(DT), angles.sin().to(DT)
    norms = [1 + 0.1 * torch.randn(head_dim, device=DEVICE, dtype=DT, generator=gen) for _ in range(2)]
    layers = []
    for i in range(case.weight_sets()):
        s = case.sets[i % len(case.sets)]
        w = torch.randn(width, case.h_in, device=DEVICE, dtype=DT, generator=gen) / case.h_in**0.5
        layers.append((s, fold_lora_weights(w, None, s["a"])))

    def norm_rope(y: torch.Tensor) -> None:
        q, k, _ = (t.view(tokens, -1, head_dim) for t in y.split(list(case.widths), dim=-1))
        qk_norm_rope(q, k, cos, sin, *norms, EPS, backend="triton")

    def unfused(s: dict, f) -> None:
        norm_rope(folded_lora_linear(s["x"], f, s["b"], case.scales, case.slots, meta=meta, backend="triton"))

    def fused(s: dict, f) -> None:
        folded_qkv_rope(s["x"], f, s["b"], case.scales, case.slots, head_dim, cos, sin, *norms, EPS, meta=meta,
                        backend="triton")

    return {
        "base_gemm_s": graph_time([lambda s=s, f=f: F.linear(s["x"], f.base_weight) for s, f in layers]),
        "base_block_s": graph_time([lambda s=s, f=f: norm_rope(F.linear(s["x"], f.base_weight)) for s, f in layers]),
        "unfused_block_s": graph_time([lambda s=s, f=f: unfused(s, f) for s, f in layers]),
        "fused_block_s": graph_time([lambda s=s, f=f: fused(s, f) for s, f in layers]),
    }


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_qkv_rope"))
    parser.add_argument("--adapters", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 4096])
    parser.add_argument("--smoke", action="store_true", help="a tiny q/k/v shape (a CPU run checking that the script runs)")
    args = parser.parse_args(argv)
    require_kernels()
    shape = "tiny.qkv" if args.smoke else "4B.qkv"
    args.out.mkdir(parents=True, exist_ok=True)
    warm_up()
    results: dict = {"device": device_name(), "shape": shape, "copy_bandwidth_Bps": copy_bandwidth(), "rows": []}
    lines = [
        f"device: {results['device']}; copy bandwidth {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s", "",
        "| N | T | base GEMM us | block without LoRA us | today's LoRA block us | fused LoRA block us "
        "| today's add-on / GEMM | fused add-on / GEMM |",
        "| --- " * 8 + "|",
    ]  # fmt: skip
    for n in args.adapters:
        for t in args.tokens:
            row = {"N": n, "T": t, **time_case(shape, n, t)}
            results["rows"].append(row)
            base = row["base_block_s"]
            us = {k: v * 1e6 for k, v in row.items() if k.endswith("_s")}
            lines.append(
                f"| {n} | {t} | {us['base_gemm_s']:.1f} | {us['base_block_s']:.1f} | {us['unfused_block_s']:.1f} | "
                f"{us['fused_block_s']:.1f} | {(row['unfused_block_s'] - base) / row['base_gemm_s']:.2f} | "
                f"**{(row['fused_block_s'] - base) / row['base_gemm_s']:.2f}** |"
            )
            print(lines[-1], flush=True)
    results["copy_bandwidth_end_Bps"] = copy_bandwidth()
    (args.out / "bench_qkv_rope.json").write_text(json.dumps(results, indent=1))
    (args.out / "bench_qkv_rope.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
