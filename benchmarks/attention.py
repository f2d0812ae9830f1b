"""Decode-attention benchmark for the GPU machine: Qwen3-1.7B's attention shape (H=16, KV=8, d=128, bf16),
cache length L=2048, B in {64, 256, 512} rows, lengths drawn uniformly in [1, 2 * mean - 1] for mean
context 256 and 1024; and the engine's shape with shared prompts (``PrefixCase``: B in {320, 512} at L=640,
the e2e's cache, and B=512 at L=5120, the same rows in a long cache: a row's cost must not grow with L).

Times, each from CUDA-graph replays (median; cache sets rotated so the K/V read per call exceed 3x the
L2): our ``decode_attention`` (Triton flash-decoding, ``out`` and workspace preallocated), torch SDPA with
a boolean mask over all L positions (what the embedded engine did before), and the memory roofline (K/V
bytes the rows' lengths need, plus q and out, / measured device copy bandwidth). ``--sweep`` also times
alternative launch configs on three cases. ``--paged BS [BS ...]`` also times each case on a paged copy of its
cache (blocks of ``BS`` positions in a random order, the table's entries past each row's length -1; with
shared prompts the members' tables name the group's first row's whole prompt blocks, as the engine's block
manager shares them), side by side with the slot layout.

    python -m benchmarks.attention --out DIR [--sweep] [--shared-only] [--paged 32 ...] [--smoke]

``--smoke``: the same cases at tiny sizes (:data:`SMOKE`), for a CPU run checking that the script runs.

Writes DIR/bench_attention.json and DIR/bench_attention.md, and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from benchmarks.common import DEVICE, L2_BYTES, copy_bandwidth, device_name, graph_time, require_kernels, warm_up

from skyrl_clora.kernels import DecodeWorkspace, decode_attention
from skyrl_clora.kernels.attention.decode import AttentionConfig, decode_attention_triton, default_attention_config

DT = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The cases: attention heads ``H``, key/value heads ``KV``, head dim ``D``, the plain cases' cache length
    ``L``, rows ``rows`` and mean contexts ``means``; the shared-prompt cases' (rows, cache length) ``shared``,
    their group size ``samples``, prompt length ``prompt`` and longest context ``context``."""

    H: int = 16
    KV: int = 8
    D: int = 128
    L: int = 2048
    rows: tuple[int, ...] = (64, 256, 512)
    means: tuple[int, ...] = (256, 1024)
    shared: tuple[tuple[int, int], ...] = ((320, 640), (512, 640), (512, 5120))
    samples: int = 8
    prompt: int = 256
    context: int = 520


SMOKE = Sizes(H=2, KV=1, D=16, L=32, rows=(2,), means=(8,), shared=((4, 32),), samples=2, prompt=8, context=20)


def paged_sets(sets: list[dict], lengths: torch.Tensor, block_size: int, seed: int = 0,
               shared: tuple[torch.Tensor, int] | None = None) -> tuple[list[dict], torch.Tensor]:
    """Paged copies of input sets (``k``, ``v``: ``[rows, KV, max_len, d]``) and their block table ``[rows,
    max_len // block_size]`` int32: every block of every row in a random place, the entries past a row's length
    -1; ``shared = (prefix_rows, prompt)``: a row's table names its prefix row's blocks below ``prompt`` (whole
    blocks only), as the engine shares a GRPO group's prompt."""
    rows, kv_heads, max_len, head_dim = sets[0]["k"].shape
    per_row = max_len // block_size
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    place = torch.randperm(rows * per_row, device=DEVICE, generator=gen)  # logical block -> physical block
    table = place.view(rows, per_row).int()
    if shared is not None:
        prefix_rows, prompt = shared
        whole = prompt // block_size
        table[:, :whole] = table[prefix_rows.long(), :whole]
    table[torch.arange(per_row, device=DEVICE)[None, :] * block_size >= lengths[:, None]] = -1
    out = []
    for s in sets:
        paged = dict(s)
        for name in ("k", "v"):
            blocks = s[name].unflatten(2, (per_row, block_size)).transpose(1, 2).reshape(-1, kv_heads, block_size, head_dim)
            physical = torch.empty_like(blocks)
            physical[place] = blocks
            paged[name] = physical
        out.append(paged)
    return out, table.contiguous()


class Case:
    """Input sets of one (B, mean context) case at ``sizes``' heads and cache length."""

    def __init__(self, sizes: Sizes, rows: int, mean: int, seed: int = 0) -> None:
        H, KV, D, L = sizes.H, sizes.KV, sizes.D, sizes.L
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.B = rows
        self.lengths = torch.randint(1, 2 * mean, (rows,), device=DEVICE, generator=gen, dtype=torch.int32)
        kv_bytes = int(self.lengths.sum()) * KV * D * 2 * 2  # K and V, bf16
        self.bytes = kv_bytes + 2 * rows * H * D * 2  # + q read, out written
        n_sets = max(1, min(4, math.ceil(3 * L2_BYTES / kv_bytes)))
        self.sets = [
            {
                "q": torch.randn(rows, H, D, device=DEVICE, dtype=DT, generator=gen),
                "k": torch.randn(rows, KV, L, D, device=DEVICE, dtype=DT, generator=gen),
                "v": torch.randn(rows, KV, L, D, device=DEVICE, dtype=DT, generator=gen),
                "out": torch.empty(rows, H, D, device=DEVICE, dtype=DT),
            }
            for _ in range(n_sets)
        ]
        self.ws = DecodeWorkspace(rows, H, L, D, device=DEVICE)
        self.mask = (torch.arange(L, device=DEVICE).view(1, L) < self.lengths.view(-1, 1)).view(rows, 1, 1, L)
        errs = []
        for s in self.sets[:1]:  # sanity: our kernel against the fp32 reference on this case
            got = decode_attention(s["q"], s["k"], s["v"], self.lengths, backend="triton").float()
            want = decode_attention(s["q"].float(), s["k"].float(), s["v"].float(), self.lengths, backend="torch")
            errs.append(((got - want).norm() / want.norm()).item())
        self.max_rel_error = max(errs)

    def ours(self, config: AttentionConfig | None = None) -> float:
        def call(s: dict) -> Callable[[], None]:
            if config is None:
                return lambda: decode_attention(s["q"], s["k"], s["v"], self.lengths, out=s["out"], workspace=self.ws,
                                                backend="triton")
            return lambda: decode_attention_triton(
                s["q"], s["k"], s["v"], self.lengths, out=s["out"], workspace=None, config=config
            )

        return graph_time([call(s) for s in self.sets])

    def paged(self, block_size: int) -> tuple[float, float]:
        """Seconds per call on a paged copy of the sets, and the largest relative difference from the slot call."""
        sets, table = paged_sets(self.sets, self.lengths, block_size)
        calls = [lambda s=s: decode_attention(s["q"], s["k"], s["v"], self.lengths, out=s["out"], workspace=self.ws,
                                              block_tables=table, backend="triton") for s in sets]
        return _paged_time(calls, sets, self.sets,
                           lambda s: decode_attention(s["q"], s["k"], s["v"], self.lengths, backend="triton"))

    def sdpa(self) -> float:
        def call(s: dict) -> Callable[[], None]:
            return lambda: torch.nn.functional.scaled_dot_product_attention(
                s["q"].unsqueeze(2), s["k"], s["v"], attn_mask=self.mask, enable_gqa=True
            )

        return graph_time([call(s) for s in self.sets])


class PrefixCase:
    """The engine's decode shape (benchmarks.runner's and benchmarks.e2e's): ``rows`` rows in GRPO groups of
    ``sizes.samples`` whose first ``sizes.prompt`` positions are the group's prompt, held by its first row (the
    members' copies are never read: they hold NaN here), then each row's own positions up to a length drawn
    uniformly from ``[prompt + 1, sizes.context]``; cache length ``max_len`` (benchmarks.runner's for context
    520)."""

    def __init__(self, sizes: Sizes, rows: int, max_len: int, seed: int = 0) -> None:
        H, KV, D, samples, prompt = sizes.H, sizes.KV, sizes.D, sizes.samples, sizes.prompt
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.B, self.max_len = rows, max_len
        self.lengths = torch.randint(prompt + 1, sizes.context + 1, (rows,), device=DEVICE, generator=gen,
                                     dtype=torch.int32)
        self.prefix_rows = torch.arange(rows, device=DEVICE, dtype=torch.int32) // samples * samples
        self.prefix_lens = torch.full((rows,), prompt, device=DEVICE, dtype=torch.int32)
        is_member = self.prefix_rows != torch.arange(rows, device=DEVICE)  # rows that read a group's prompt
        kv_bytes = (int(self.lengths.sum()) - int(is_member.sum()) * prompt) * KV * D * 2 * 2  # what shared reads read
        self.bytes = kv_bytes + 2 * rows * H * D * 2
        n_sets = max(1, min(4, math.ceil(3 * L2_BYTES / kv_bytes)))
        self.sets = []
        for _ in range(n_sets):
            k = torch.randn(rows, KV, max_len, D, device=DEVICE, dtype=DT, generator=gen)
            v = torch.randn(rows, KV, max_len, D, device=DEVICE, dtype=DT, generator=gen)
            k[is_member, :, :prompt] = float("nan")
            v[is_member, :, :prompt] = float("nan")
            self.sets.append({"q": torch.randn(rows, H, D, device=DEVICE, dtype=DT, generator=gen), "k": k, "v": v,
                              "out": torch.empty(rows, H, D, device=DEVICE, dtype=DT)})
        self.ws = DecodeWorkspace(rows, H, max_len, D, device=DEVICE)
        s = self.sets[0]
        self.call(s, None)()
        want = decode_attention(s["q"].float(), s["k"].float(), s["v"].float(), self.lengths, backend="torch",
                                prefix_rows=self.prefix_rows, prefix_lens=self.prefix_lens)
        self.max_rel_error = ((s["out"].float() - want).norm() / want.norm()).item()

    def call(self, s: dict, config: AttentionConfig | None) -> Callable[[], None]:
        """One call on input set ``s``; a swept ``config`` allocates its own workspace (its split length may
        need more partials than the default's)."""
        ws = self.ws if config is None else None
        return lambda: decode_attention_triton(s["q"], s["k"], s["v"], self.lengths, out=s["out"], workspace=ws,
                                               config=config, prefix_rows=self.prefix_rows, prefix_lens=self.prefix_lens)

    def ours(self, config: AttentionConfig | None = None) -> float:
        return graph_time([self.call(s, config) for s in self.sets])

    def paged(self, block_size: int) -> tuple[float, float]:
        """As ``Case.paged``, the members' tables naming their group's prompt blocks."""
        sets, table = paged_sets(self.sets, self.lengths, block_size, shared=(self.prefix_rows, int(self.prefix_lens[0])))
        prefix = {"prefix_rows": self.prefix_rows, "prefix_lens": self.prefix_lens, "backend": "triton"}
        calls = [lambda s=s: decode_attention(s["q"], s["k"], s["v"], self.lengths, out=s["out"], workspace=self.ws,
                                              block_tables=table, **prefix) for s in sets]
        return _paged_time(calls, sets, self.sets, lambda s: decode_attention(s["q"], s["k"], s["v"], self.lengths, **prefix))


def _paged_time(calls: list[Callable[[], None]], paged: list[dict], slot: list[dict],
                slot_call: Callable[[dict], torch.Tensor]) -> tuple[float, float]:
    """Seconds per paged call, and the largest relative difference of a paged output from the slot layout's."""
    seconds = graph_time(calls)
    diff = 0.0
    for call, p, s in zip(calls, paged, slot):
        call()
        want = slot_call(s).float()
        diff = max(diff, ((p["out"].float() - want).norm() / want.norm()).item())
    del paged
    torch.cuda.empty_cache()
    return seconds, diff


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_attention"))
    parser.add_argument("--sweep", action="store_true", help="time alternative launch configs on three cases")
    parser.add_argument("--shared-only", action="store_true", help="only the shared-prompt cases")
    parser.add_argument("--paged", type=int, nargs="+", default=[], metavar="BS",
                        help="also time each case on a paged cache of BS-position blocks")
    parser.add_argument("--smoke", action="store_true", help="tiny cases (a CPU run checking that the script runs)")
    args = parser.parse_args(argv)
    require_kernels()
    sizes = SMOKE if args.smoke else Sizes()
    args.out.mkdir(parents=True, exist_ok=True)
    warm_up()
    bandwidth = copy_bandwidth()
    results: dict = {"device": device_name(), "copy_bandwidth_Bps": bandwidth, "sizes": dataclasses.asdict(sizes),
                     "table": [], "sweep": []}
    lines = [
        f"device: {results['device']}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); "
        f"H={sizes.H} KV={sizes.KV} d={sizes.D} L={sizes.L} bf16",
    ]
    paged_head = "".join(f" paged BS={bs} us | paged/slot |" for bs in args.paged)
    paged_rule = " --- | --- |" * len(args.paged)
    if not args.shared_only:
        lines += [
            "",
            "| B | mean ctx | split_len | ours us | SDPA (mask over L) us | SDPA/ours | roofline us | ours/roofline "
            "| rel err vs fp32 |" + paged_head,
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + paged_rule,
        ]
    for rows in () if args.shared_only else sizes.rows:
        for mean in sizes.means:
            case = Case(sizes, rows, mean)
            r = {"B": rows, "mean": mean, "mean_measured": case.lengths.float().mean().item(), "bytes": case.bytes,
                 "split_len": default_attention_config(sizes.L).split_len, "ours_s": case.ours(),
                 "sdpa_s": case.sdpa(), "roofline_s": case.bytes / bandwidth, "rel_error": case.max_rel_error}  # fmt: skip
            results["table"].append(r)
            lines.append(
                f"| {rows} | {mean} | {r['split_len']} | {r['ours_s'] * 1e6:.1f} | {r['sdpa_s'] * 1e6:.1f} | "
                f"{r['sdpa_s'] / r['ours_s']:.1f} | {r['roofline_s'] * 1e6:.1f} | {r['ours_s'] / r['roofline_s']:.2f} | "
                f"{r['rel_error']:.1e} |" + _paged_cells(case, r, args.paged)
            )
            print(lines[-1], flush=True)
            if args.sweep and (rows, mean) in ((64, 256), (512, 1024)):
                configs = [AttentionConfig(split_len=s, block_n=bn) for s in (128, 256, 512) for bn in (32, 64)]
                configs += [AttentionConfig(num_warps=8), AttentionConfig(num_stages=3)]
                configs += [AttentionConfig(block_n=128, num_warps=8), AttentionConfig(maxnreg=128), AttentionConfig(maxnreg=96)]
                configs += [AttentionConfig(reduce_warps=w) for w in (1, 2, 4)]
                timed = {repr(c): case.ours(c) for c in configs}
                results["sweep"].append({"B": rows, "mean": mean, "times_s": timed})
                best = min(timed, key=timed.get)
                print(f"sweep B={rows} mean={mean}: " + ", ".join(f"{k}: {v * 1e6:.1f}" for k, v in timed.items()), flush=True)
                lines.append(f"| sweep | best of {len(configs)}: {best} | | {timed[best] * 1e6:.1f} | | | | | |")
            del case
            torch.cuda.empty_cache()
    lines += ["", f"Shared prompts (groups of {sizes.samples}, {sizes.prompt}-position prompt read once per group, lengths "
              f"in [{sizes.prompt + 1}, {sizes.context}]):", "",
              "| B | L | split_len | ours us | roofline us | ours/roofline | rel err vs fp32 |" + paged_head,
              "| --- | --- | --- | --- | --- | --- | --- |" + paged_rule]
    for rows, max_len in sizes.shared:
        case = PrefixCase(sizes, rows, max_len)
        r = {"B": rows, "L": max_len, "case": "shared prompts", "split_len": default_attention_config(max_len).split_len,
             "bytes": case.bytes, "ours_s": case.ours(), "roofline_s": case.bytes / bandwidth, "rel_error": case.max_rel_error}
        results["table"].append(r)
        lines.append(f"| {rows} | {max_len} | {r['split_len']} | {r['ours_s'] * 1e6:.1f} | {r['roofline_s'] * 1e6:.1f} | "
                     f"{r['ours_s'] / r['roofline_s']:.2f} | {r['rel_error']:.1e} |" + _paged_cells(case, r, args.paged))
        print(lines[-1], flush=True)
        if args.sweep and (rows, max_len) == (512, 640):
            configs = [AttentionConfig(maxnreg=cap, num_stages=st) for cap in (0, 128, 112, 96, 80) for st in (2, 3)]
            configs += [AttentionConfig(reduce_warps=w) for w in (1, 2, 4)] + [AttentionConfig(pdl=False)]
            timed = {repr(c): case.ours(c) for c in configs}
            results["sweep"].append({"B": rows, "case": "shared prompts", "times_s": timed})
            for name, t in sorted(timed.items(), key=lambda item: item[1]):
                lines.append(f"| sweep: {name} | | | {t * 1e6:.1f} | | {t / r['roofline_s']:.2f} | |")
            print("\n".join(lines[-len(configs):]), flush=True)
        del case
        torch.cuda.empty_cache()
    (args.out / "bench_attention.json").write_text(json.dumps(results, indent=1))
    (args.out / "bench_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _paged_cells(case: Case | PrefixCase, r: dict, block_sizes: list[int]) -> str:
    """Times ``case`` paged at each block size into ``r`` (``paged_s``, ``paged_rel_diff``: by block size) and
    returns the table cells."""
    cells = ""
    for block_size in block_sizes:
        seconds, diff = case.paged(block_size)
        r.setdefault("paged_s", {})[block_size] = seconds
        r.setdefault("paged_rel_diff", {})[block_size] = diff
        cells += f" {seconds * 1e6:.1f} | {seconds / r['ours_s']:.3f} |"
    return cells


if __name__ == "__main__":
    main()
