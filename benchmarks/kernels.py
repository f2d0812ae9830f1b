"""Multi-LoRA kernel benchmark for the GPU machine (issue 3).

For hidden 4096 and the Qwen3-4B projections, N adapters in {1, 8, 32}, tokens in {16, 64, 256, 4096} and
rank in {16, 64} (bf16, uniform random adapter per row) it times, each from CUDA-graph replays (median
over repeats, inputs rotated over enough sets to leave the L2 cache): our ``add_lora`` (shrink + expand,
all slices; the per-step ``LoRAMeta.build`` is not included and is timed on its own), the folded layer
(``kernels.lora.folded``: one GEMM over the base weight with every slot's A appended, one expand; its LoRA add-on
is the layer's time minus the base GEMM's over the same weights, timed side by side), a PEFT-style loop
over adapters and slices, gather + bmm, the base layer's GEMM alone, and the memory roofline (bytes the
op must move / measured device copy bandwidth). Then packed LoRA training (forward + backward of the
LoRA part) against the adapters one after another. ``--sweep`` also times alternative launch configs.

    python -m benchmarks.kernels --out DIR [--sweep decode|prefill|all] [--quick] [--lean] [--tokens T ...]
        [--ranks R ...] [--adapters N ...]
    python -m benchmarks.kernels --out DIR --packed-sweep [--packed-configs JSON]
    python -m benchmarks.kernels --out DIR --smoke --tokens 4 --ranks 8 --adapters 2

``--smoke``: the main table, LoRAMeta.build and packed training at tiny sizes (``SMOKE_SHAPES``,
``SMOKE_META_BUILD``, ``SMOKE_PACKED``), for a CPU run checking that the script runs.

``--lean`` leaves out the PEFT loop, gather + bmm and the no-PDL variant (the issue's targets need only ours,
the folded layer and the base GEMM). ``--packed-sweep`` times packed training under launch configs of its
kernels (``PackedConfig``; ``PACKED_SWEEP``, or the JSON list of changes to the defaults given, e.g.
``'[{}, {"fwd_rows": 16, "x_target_programs": 128}]'``) instead of the packed table and the main table.

Prints the tables last; writes every number to DIR/bench_kernels.json and the tables to
DIR/bench_kernels.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

import torch.nn.functional as F

from benchmarks.common import DEVICE, DT, L2_BYTES, copy_bandwidth, device_name, graph_time, require_kernels, warm_up
from benchmarks.packed import PACKED_SWEEP, SMOKE_PACKED, PackedCase, packed_sweep, packed_training
from skyrl_clora.kernels import LoRAMeta, add_lora, fold_lora_weights
from skyrl_clora.kernels.lora.folded import folded_lora_linear_triton
from skyrl_clora.kernels.lora.meta import rank_pad
from skyrl_clora.kernels.lora.sgmv import SgmvConfig, add_lora_triton, default_config, expand_folded, sgmv_expand, sgmv_shrink

SHAPES = {  # name: (h_in, output slices, one A per slice)
    "h4096": (4096, (4096,), False),
    "4B.qkv": (2560, (4096, 1024, 1024), True),
    "4B.o": (4096, (2560,), False),
    "4B.gate_up": (2560, (9728, 9728), True),
    "4B.down": (9728, (2560,), False),
}
SMOKE_SHAPES = {"tiny": (64, (128,), False), "tiny.qkv": (64, (64, 32, 32), True)}  # --smoke's
META_BUILD = ("h4096", 32, 16, (16, 256, 4096))  # LoRAMeta.build's table: shape, N, rank, token counts
SMOKE_META_BUILD = ("tiny", 2, 8, (16,))


class Case:
    """Input sets of one (shape, N, T, rank) case, rotated so each call misses the L2 cache (``shape``: a key of
    ``SHAPES`` or ``SMOKE_SHAPES``)."""

    def __init__(self, shape: str, n_adapters: int, tokens: int, rank: int, seed: int = 0):
        self.h_in, self.widths, self.per_slice = {**SHAPES, **SMOKE_SHAPES}[shape]
        self.N, self.T, self.R = n_adapters, tokens, rank
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.slots = torch.randint(0, n_adapters, (tokens,), device=DEVICE, generator=gen)
        self.active = self.slots.unique().tolist()
        n_a = len(self.widths) if self.per_slice else 1
        width = sum(self.widths)
        lora_bytes = 2 * (n_adapters * rank * (self.h_in * n_a + width))
        io_bytes = 2 * tokens * (self.h_in + width)
        self.n_sets = max(1, min(64, math.ceil(3 * L2_BYTES / (lora_bytes + io_bytes))))
        self.sets = []
        for _ in range(self.n_sets):
            a_shape = (n_a, n_adapters, rank, self.h_in) if self.per_slice else (n_adapters, rank, self.h_in)
            self.sets.append({
                "x": torch.randn(tokens, self.h_in, device=DEVICE, dtype=DT, generator=gen),
                "out": torch.randn(tokens, width, device=DEVICE, dtype=DT, generator=gen),
                "a": torch.randn(a_shape, device=DEVICE, dtype=DT, generator=gen) / self.h_in**0.5,
                "b": tuple(torch.randn(n_adapters, w, rank, device=DEVICE, dtype=DT, generator=gen) for w in self.widths),
            })  # fmt: skip
        self.scales = torch.full((n_adapters,), 2.0, device=DEVICE)
        self.meta = LoRAMeta(max_tokens=tokens, num_slots=n_adapters, device=DEVICE, max_rank=rank)
        self.meta.build(self.slots)
        # what the op must move: x, the active adapters' weights, out read and written
        n_act = len(self.active)
        self.bytes = 2 * (tokens * self.h_in + n_act * rank * (self.h_in * n_a + width) + 2 * tokens * width)

    def ours_without_pdl(self) -> float | None:
        """Our op with the default config but no programmatic dependent launch (None where the default has none)."""
        cfg = default_config(self.T, self.h_in, self.N, len(self.widths) if self.per_slice else 1, self.R)
        return self.ours(dataclasses.replace(cfg, pdl=False)) if cfg.pdl else None

    def ours(self, config: SgmvConfig | None = None) -> float:
        def call(s: dict) -> Callable[[], None]:
            if config is None:
                return lambda: add_lora(s["out"], s["x"], s["a"], s["b"], self.scales, self.slots, meta=self.meta,
                                    backend="triton")
            return lambda: add_lora_triton(
                s["out"], s["x"], s["a"], s["b"], self.scales, self.slots, meta=self.meta, config=config
            )

        return graph_time([call(s) for s in self.sets])

    def parts(self) -> tuple[float, float]:
        """Shrink alone and expand alone under the default config (seconds per call)."""
        cfg = default_config(self.T, self.h_in, self.N, len(self.widths) if self.per_slice else 1, self.R)
        n_a = len(self.widths) if self.per_slice else 1
        split = min(cfg.split_k, self.meta.workspace.numel() // (n_a * self.T * rank_pad(self.R)))
        ws = self.meta.workspace[: split * n_a * self.T * rank_pad(self.R)].view(split, n_a, self.T, rank_pad(self.R))
        a4 = [s["a"] if self.per_slice else s["a"].unsqueeze(0) for s in self.sets]
        shrink = graph_time([lambda a=a, s=s: sgmv_shrink(ws, s["x"], a, self.meta, self.R, cfg) for a, s in zip(a4, self.sets)])
        expand = graph_time(
            [lambda s=s: sgmv_expand(s["out"], ws, s["b"], self.scales, self.meta, self.R, cfg) for s in self.sets]
        )
        return shrink, expand

    def peft_loop(self) -> float:
        rows = [(s, (self.slots == s).nonzero().flatten()) for s in self.active]
        cols = [sum(self.widths[:i]) for i in range(len(self.widths))]

        def call(st: dict) -> Callable[[], None]:
            def run() -> None:
                for s, idx in rows:
                    xs = st["x"].index_select(0, idx)
                    for i, b in enumerate(st["b"]):
                        a = st["a"][i] if self.per_slice else st["a"]
                        delta = (xs @ a[s].T) @ b[s].T * 2.0
                        st["out"][:, cols[i] : cols[i] + b.shape[1]].index_add_(0, idx, delta)

            return run

        return graph_time([call(s) for s in self.sets[: max(1, min(len(self.sets), 4))]], min_calls=4)

    def gather_bmm(self) -> float:
        cols = [sum(self.widths[:i]) for i in range(len(self.widths))]

        def call(st: dict) -> Callable[[], None]:
            def run() -> None:
                for i, b in enumerate(st["b"]):
                    a = st["a"][i] if self.per_slice else st["a"]
                    h = torch.bmm(a[self.slots], st["x"].unsqueeze(2))  # [T, R, 1]
                    delta = torch.bmm(b[self.slots], h).squeeze(2) * self.scales[self.slots, None]
                    st["out"][:, cols[i] : cols[i] + b.shape[1]].add_(delta)

            return run

        return graph_time([call(self.sets[0])], min_calls=4)

    def weight_sets(self) -> int:
        """How many base weights of this layer to rotate over so that each call misses the L2 cache (1-16)."""
        return max(1, min(16, math.ceil(3 * L2_BYTES / (2 * sum(self.widths) * self.h_in))))

    def base_gemm(self) -> float:
        width = sum(self.widths)
        ws = [torch.randn(width, self.h_in, device=DEVICE, dtype=DT) for _ in range(self.weight_sets())]
        outs = [s["out"] for s in self.sets]
        xs = [s["x"] for s in self.sets]
        calls = [
            (lambda w=w, x=xs[i % len(xs)], o=outs[i % len(outs)]: torch.matmul(x, w.T, out=o))
            for i, w in enumerate(ws)
        ]
        return graph_time(calls)

    def folded(self) -> tuple[float, float]:
        """(the folded layer: GEMM over ``[W; A]`` + expand, the base GEMM ``x @ W.T`` alone), seconds per call,
        over the same rotated weights, so that their difference is what the LoRA adds to the layer."""
        width = sum(self.widths)
        layers = []
        for i in range(self.weight_sets()):
            s = self.sets[i % len(self.sets)]
            a = s["a"] if self.per_slice else s["a"].unsqueeze(0)
            w = torch.randn(width, self.h_in, device=DEVICE, dtype=DT) / self.h_in**0.5
            layers.append((s, fold_lora_weights(w, None, a)))
        with_lora = graph_time([
            lambda s=s, f=f: folded_lora_linear_triton(s["x"], f, s["b"], self.scales, self.slots, self.meta)
            for s, f in layers
        ])  # fmt: skip
        base = graph_time([lambda s=s, f=f: F.linear(s["x"], f.base_weight) for s, f in layers])
        return with_lora, base

    def meta_build(self) -> float:
        return graph_time([lambda: self.meta.build(self.slots)])


def sweep(results: dict, which: str) -> list[str]:
    """Times alternative launch configs on hidden 4096 and the K=9728 shape; returns table lines.

    ``decode``: tile and split sizes at 16 and 256 tokens, rank 16. ``prefill``: at 4096 tokens, rank 16
    and 64, the default next to its variants with 4 or 8 warps and twice the splits.
    """
    lines = [
        "| shape | N | T | r | default us | shrink us | expand us | best us | best config |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    cases = [(t, 16) for t in (16, 256)] if which in ("decode", "all") else []
    cases += [(4096, r) for r in (16, 64)] if which in ("prefill", "all") else []
    for shape in ("h4096", "4B.down"):
        for n in (8, 32):
            for t, rank in cases:
                case = Case(shape, n, t, rank)
                default = default_config(t, case.h_in, n, 1, rank)
                timed = {"default": case.ours()}
                shrink, expand = case.parts()
                if t <= 256:
                    configs = [
                        SgmvConfig(block_m=16, block_k=bk, block_n=bn, split_k=sk)
                        for bk in (64, 128) for bn in (128, 256) for sk in (8, 16, 32)
                    ]  # fmt: skip
                else:
                    configs = [
                        dataclasses.replace(default, num_warps=4),
                        dataclasses.replace(default, num_warps=8),
                        dataclasses.replace(default, split_k=2 * default.split_k),
                    ]
                for cfg in configs:
                    timed[repr(cfg)] = case.ours(cfg)
                best = min(timed, key=timed.get)
                results["sweep"].append(
                    {"shape": shape, "N": n, "T": t, "rank": rank, "default": repr(default), "times_s": timed,
                     "parts_s": [shrink, expand]}
                )  # fmt: skip
                lines.append(
                    f"| {shape} | {n} | {t} | {rank} | {timed['default'] * 1e6:.1f} | {shrink * 1e6:.1f} | "
                    f"{expand * 1e6:.1f} | {timed[best] * 1e6:.1f} | {best} |"
                )
                print(lines[-1], flush=True)
    return lines


def folded_sweep(results: dict) -> list[str]:
    """The folded layer's parts for the q/k/v shape (and hidden 4096 beside it): the base GEMM, the GEMM over
    ``[W; A]`` with its row count padded to multiples of 1 / 256 / 512 (zero rows), and ``expand_folded`` alone
    under the default config and variants of its column tile and warps."""
    lines = [
        "| shape | N | T | base GEMM us | [W; A] GEMM us (pad 1 / 256 / 512) | expand default us | best expand us "
        "| best config |",
        "| --- " * 8 + "|",
    ]
    for shape in ("4B.qkv", "h4096"):
        for n in (8, 32):
            for t in (16, 64, 256, 4096):
                case = Case(shape, n, t, 16)
                width, n_a = sum(case.widths), len(case.widths) if case.per_slice else 1
                n_w = case.weight_sets()
                weights = [torch.randn(width, case.h_in, device=DEVICE, dtype=DT) for _ in range(n_w)]
                sets = [case.sets[i % len(case.sets)] for i in range(n_w)]
                base = graph_time([lambda s=s, w=w: F.linear(s["x"], w) for s, w in zip(sets, weights)])
                gemms = []
                for multiple in (1, 256, 512):
                    extra = n_a * n * 16
                    pad = -(width + extra) % multiple
                    ext = [torch.cat([w, s["a"].reshape(-1, case.h_in), w.new_zeros(pad, case.h_in)])
                           for s, w in zip(sets, weights)]
                    gemms.append(graph_time([lambda s=s, w=w: F.linear(s["x"], w) for s, w in zip(sets, ext)]))
                    del ext
                ys = [torch.randn(t, width + n_a * n * 16, device=DEVICE, dtype=DT) for _ in case.sets]
                default = default_config(t, case.h_in, n, n_a, 16)

                def expand(cfg: SgmvConfig) -> float:
                    return graph_time([
                        lambda s=s, y=y, c=case: expand_folded(y[:, :width], y[:, width:].view(t, n_a, n, 16), s["b"],
                                                               c.scales, c.meta, 16, cfg)
                        for s, y in zip(case.sets, ys)
                    ])  # fmt: skip

                timed = {repr(default): expand(default)}
                for bn in (64, 128, 256):
                    for warps in (2, 4, 8):
                        cfg = dataclasses.replace(default, block_n=bn, num_warps=warps)
                        if repr(cfg) not in timed:
                            timed[repr(cfg)] = expand(cfg)
                best = min(timed, key=timed.get)
                row = {"shape": shape, "N": n, "T": t, "base_s": base, "gemm_pad_s": gemms, "expand_s": timed}
                results["folded_sweep"].append(row)
                lines.append(
                    f"| {shape} | {n} | {t} | {base * 1e6:.1f} | {' / '.join(f'{g * 1e6:.1f}' for g in gemms)} | "
                    f"{timed[repr(default)] * 1e6:.1f} | {timed[best] * 1e6:.1f} | {best} |"
                )
                print(lines[-1], flush=True)
    return lines


def main_table(
    results: dict, bandwidth: float, shapes: tuple[str, ...], lean: bool, tokens: tuple[int, ...],
    ranks: tuple[int, ...], adapters: tuple[int, ...], meta_build: tuple[str, int, int, tuple[int, ...]],
) -> list[str]:
    """The main table over ``shapes`` x ``ranks`` x ``adapters`` x ``tokens``, then ``LoRAMeta.build`` alone at
    ``meta_build`` (shape, N, rank, token counts); returns table lines."""
    lines = [
        "| shape | N | T | r | ours us | no-PDL us | base GEMM us | ours/base | folded layer us | its base us "
        "| folded add-on us | add-on/base | PEFT loop us | PEFT/ours | gather+bmm us | gather/ours | roofline us "
        "| ours/roofline |",
        "| --- " * 18 + "|",
    ]
    for shape in shapes:
        for rank in ranks:
            for n in adapters:
                for t in tokens:
                    r: dict = {"shape": shape, "N": n, "T": t, "rank": rank}
                    try:
                        case = Case(shape, n, t, rank)
                        r["bytes"] = case.bytes
                        r["ours_s"] = case.ours()
                        r["no_pdl_s"] = None if lean else case.ours_without_pdl()
                        r["base_s"] = case.base_gemm()
                        r["folded_s"], r["folded_base_s"] = case.folded()
                        r["peft_s"] = None if lean else case.peft_loop()
                        r["gather_s"] = None if lean else case.gather_bmm()
                        r["roofline_s"] = case.bytes / bandwidth
                        del case
                    except Exception as e:  # a failed row is reported in the table, the others still run
                        r["error"] = repr(e)
                        results["table"].append(r)
                        lines.append(f"| {shape} | {n} | {t} | {rank} | error: {e!r} |")
                        print(lines[-1], flush=True)
                        continue
                    results["table"].append(r)
                    us = {k: (None if v is None else v * 1e6) for k, v in r.items() if k.endswith("_s")}
                    add_on = us["folded_s"] - us["folded_base_s"]

                    def cell(key: str, ratio_to: str | None = None) -> str:
                        if us[key] is None:
                            return "- |" if ratio_to is None else "- | - |"
                        return f"{us[key]:.1f} |" + ("" if ratio_to is None else f" {us[key] / us[ratio_to]:.1f} |")

                    lines.append(
                        f"| {shape} | {n} | {t} | {rank} | {us['ours_s']:.1f} | {cell('no_pdl_s')} {us['base_s']:.1f} | "
                        f"{us['ours_s'] / us['base_s']:.2f} | {us['folded_s']:.1f} | {us['folded_base_s']:.1f} | "
                        f"{add_on:.1f} | {add_on / us['folded_base_s']:.2f} | {cell('peft_s', 'ours_s')} "
                        f"{cell('gather_s', 'ours_s')} {us['roofline_s']:.1f} | {us['ours_s'] / us['roofline_s']:.1f} |"
                    )
                    print(lines[-1], flush=True)
    lines += ["", "| T | N | LoRAMeta.build us (once per step) |", "| --- | --- | --- |"]
    shape, n, rank, token_counts = meta_build
    for t in token_counts:
        case = Case(shape, n, t, rank)
        us = case.meta_build() * 1e6
        results["meta_build"].append({"T": t, "N": n, "s": us * 1e-6})
        lines.append(f"| {t} | {n} | {us:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_kernels"))
    parser.add_argument("--sweep", choices=["decode", "prefill", "all"], help="time alternative launch configs")
    parser.add_argument("--folded-sweep", action="store_true", help="the folded layer's parts and expand configs")
    parser.add_argument("--no-table", action="store_true", help="skip the main table")
    parser.add_argument("--quick", action="store_true", help="hidden 4096 only in the main table")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 4096], help="main table token counts")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64], help="main table ranks")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32], help="main table adapter counts")
    parser.add_argument("--lean", action="store_true", help="main table: ours, the folded layer and the base GEMM")
    parser.add_argument("--no-packed", action="store_true", help="skip packed training")
    parser.add_argument("--packed-sweep", action="store_true",
                        help="packed training under launch-config variants, instead of the packed table and the main table")
    parser.add_argument("--packed-configs", type=json.loads, metavar="JSON",
                        help="the packed sweep's configs (implies --packed-sweep): a JSON list of dicts of PackedConfig "
                             "fields to change (default: PACKED_SWEEP)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in the main table, LoRAMeta.build and packed training (a CPU run checking "
                             "that the script runs)")
    args = parser.parse_args(argv)
    require_kernels()
    args.packed_sweep = args.packed_sweep or args.packed_configs is not None
    if args.packed_sweep:
        args.no_packed = args.no_table = True
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": device_name(), "sweep": [], "folded_sweep": [], "table": [], "meta_build": []}
    lines: list[str] = []

    def save() -> None:  # after every section, so a run cut short keeps what it measured
        (args.out / "bench_kernels.json").write_text(json.dumps(results, indent=1))
        (args.out / "bench_kernels.md").write_text("\n".join(lines) + "\n")

    warm_up()
    bandwidth = copy_bandwidth()
    results["copy_bandwidth_Bps"] = bandwidth
    lines += [f"device: {results['device']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", ""]
    if not args.no_packed:
        lines += packed_training(results, bandwidth, PackedCase(**SMOKE_PACKED) if args.smoke else PackedCase()) + [""]
        save()
    if args.packed_sweep:
        lines += packed_sweep(results, args.packed_configs or PACKED_SWEEP) + [""]
        save()
    if args.sweep:
        lines += sweep(results, args.sweep) + [""]
        save()
    if args.folded_sweep:
        lines += folded_sweep(results) + [""]
        save()
    if not args.no_table:
        shapes = tuple(SMOKE_SHAPES) if args.smoke else ("h4096",) if args.quick else tuple(SHAPES)
        lines += main_table(results, bandwidth, shapes, args.lean, tuple(args.tokens), tuple(args.ranks),
                            tuple(args.adapters), SMOKE_META_BUILD if args.smoke else META_BUILD)
    results["copy_bandwidth_end_Bps"] = copy_bandwidth()
    lines += ["", f"copy bandwidth at the end: {results['copy_bandwidth_end_Bps'] / 1e12:.2f} TB/s"]
    save()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
