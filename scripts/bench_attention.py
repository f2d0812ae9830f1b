"""Decode-attention benchmark for the GPU machine: Qwen3-1.7B's attention shape (H=16, KV=8, d=128, bf16),
cache length L=2048, B in {64, 256, 512} rows, lengths drawn uniformly in [1, 2 * mean - 1] for mean
context 256 and 1024.

Times, each from CUDA-graph replays (median; cache sets rotated so the K/V read per call exceed 3x the
L2): our ``decode_attention`` (Triton flash-decoding, ``out`` and workspace preallocated), torch SDPA with
a boolean mask over all L positions (what the embedded engine did before), and the memory roofline (K/V
bytes the rows' lengths need, plus q and out, / measured device copy bandwidth). ``--sweep`` also times
alternative launch configs on two cases.

    python scripts/bench_attention.py --out DIR [--sweep]

Writes DIR/bench_attention.json and DIR/bench_attention.md, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from bench_kernels import L2_BYTES, copy_bandwidth, graph_time, warm_up

from skyrl_clora.kernels import DecodeWorkspace, decode_attention
from skyrl_clora.kernels.attention import AttentionConfig, decode_attention_triton, default_attention_config

DT = torch.bfloat16
H, KV, D, L = 16, 8, 128, 2048


class Case:
    """Input sets of one (B, mean context) case."""

    def __init__(self, rows: int, mean: int, seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.B = rows
        self.lengths = torch.randint(1, 2 * mean, (rows,), device="cuda", generator=gen, dtype=torch.int32)
        kv_bytes = int(self.lengths.sum()) * KV * D * 2 * 2  # K and V, bf16
        self.bytes = kv_bytes + 2 * rows * H * D * 2  # + q read, out written
        n_sets = max(1, min(4, math.ceil(3 * L2_BYTES / kv_bytes)))
        self.sets = [
            {
                "q": torch.randn(rows, H, D, device="cuda", dtype=DT, generator=gen),
                "k": torch.randn(rows, KV, L, D, device="cuda", dtype=DT, generator=gen),
                "v": torch.randn(rows, KV, L, D, device="cuda", dtype=DT, generator=gen),
                "out": torch.empty(rows, H, D, device="cuda", dtype=DT),
            }
            for _ in range(n_sets)
        ]
        self.ws = DecodeWorkspace(rows, H, L, D, device="cuda")
        self.mask = (torch.arange(L, device="cuda").view(1, L) < self.lengths.view(-1, 1)).view(rows, 1, 1, L)
        errs = []
        for s in self.sets[:1]:  # sanity: our kernel against the fp32 reference on this case
            got = decode_attention(s["q"], s["k"], s["v"], self.lengths).float()
            want = decode_attention(s["q"].float(), s["k"].float(), s["v"].float(), self.lengths, backend="torch")
            errs.append(((got - want).norm() / want.norm()).item())
        self.max_rel_error = max(errs)

    def ours(self, config: AttentionConfig | None = None) -> float:
        def call(s: dict) -> Callable[[], None]:
            if config is None:
                return lambda: decode_attention(s["q"], s["k"], s["v"], self.lengths, out=s["out"], workspace=self.ws)
            return lambda: decode_attention_triton(
                s["q"], s["k"], s["v"], self.lengths, out=s["out"], workspace=None, config=config
            )

        return graph_time([call(s) for s in self.sets])

    def sdpa(self) -> float:
        def call(s: dict) -> Callable[[], None]:
            return lambda: torch.nn.functional.scaled_dot_product_attention(
                s["q"].unsqueeze(2), s["k"], s["v"], attn_mask=self.mask, enable_gqa=True
            )

        return graph_time([call(s) for s in self.sets])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_attention"))
    parser.add_argument("--sweep", action="store_true", help="time alternative launch configs on two cases")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    warm_up()
    bandwidth = copy_bandwidth()
    results: dict = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bandwidth, "table": [], "sweep": []}
    lines = [
        f"device: {results['device']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); "
        f"H={H} KV={KV} d={D} L={L} bf16",
        "",
        "| B | mean ctx | split_len | ours us | SDPA (mask over L) us | SDPA/ours | roofline us | ours/roofline "
        "| rel err vs fp32 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rows in (64, 256, 512):
        for mean in (256, 1024):
            case = Case(rows, mean)
            r = {"B": rows, "mean": mean, "mean_measured": case.lengths.float().mean().item(), "bytes": case.bytes,
                 "split_len": default_attention_config(L).split_len, "ours_s": case.ours(),
                 "sdpa_s": case.sdpa(), "roofline_s": case.bytes / bandwidth, "rel_error": case.max_rel_error}  # fmt: skip
            results["table"].append(r)
            lines.append(
                f"| {rows} | {mean} | {r['split_len']} | {r['ours_s'] * 1e6:.1f} | {r['sdpa_s'] * 1e6:.1f} | "
                f"{r['sdpa_s'] / r['ours_s']:.1f} | {r['roofline_s'] * 1e6:.1f} | {r['ours_s'] / r['roofline_s']:.2f} | "
                f"{r['rel_error']:.1e} |"
            )
            print(lines[-1], flush=True)
            if args.sweep and (rows, mean) in ((64, 256), (512, 1024)):
                configs = [AttentionConfig(split_len=s, block_n=bn) for s in (64, 128, 256, 512) for bn in (32, 64)]
                configs += [
                    AttentionConfig(split_len=256, block_n=64, num_warps=8),
                    AttentionConfig(split_len=256, block_n=64, num_stages=3),
                    AttentionConfig(split_len=256, block_n=128, num_warps=8),
                ]
                timed = {repr(c): case.ours(c) for c in configs}
                results["sweep"].append({"B": rows, "mean": mean, "times_s": timed})
                best = min(timed, key=timed.get)
                print(f"sweep B={rows} mean={mean}: " + ", ".join(f"{k}: {v * 1e6:.1f}" for k, v in timed.items()), flush=True)
                lines.append(f"| sweep | best of {len(configs)}: {best} | | {timed[best] * 1e6:.1f} | | | | | |")
            del case
            torch.cuda.empty_cache()
    (args.out / "bench_attention.json").write_text(json.dumps(results, indent=1))
    (args.out / "bench_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
