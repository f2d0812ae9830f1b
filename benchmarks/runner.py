"""The engine's forward passes at the end-to-end workload's shapes, timed and profiled on the calling thread.

benchmarks.e2e's engine runs on its own thread, where torch.profiler records kernels but no operators; this
script drives a :class:`ModelRunner` directly, so every kernel is attributed to the operator that launched
it. Model: a Qwen3-shaped model with random bf16 weights and ``--tenants`` random rank-16 adapters; the
rows are mixed over the adapters. Cases:

- ``decode``: one CUDA-graph replay per step (an eager pass on the CPU) at ``--spans`` rows, each row a GRPO sample: rows in groups of
  ``--samples`` hold the same ``--prompt``-position prefix (copied K/V), then their own positions up to a
  length drawn uniformly from ``[prompt + 1, --context]``. Timed with decode attention reading each row's own
  copy (``share_prefix_reads`` off) and reading the group's prefix from its first row (on), side by side.
  Reported beside the memory roofline: all weights once plus the K/V bytes each form must read, over the
  copy bandwidth measured in the same run.
- ``prefill turn``: the next turn of ``--jobs`` episodes: each job's first ``--history`` positions are in
  its cache row, ``--observation`` + 1 new positions are computed (the engine's call after a tool result).
  Both prefill cases are timed eager and (on CUDA) replayed from CUDA graphs.
- ``prefill prompt``: the first turn of ``--jobs`` episodes in groups of ``--samples``: one job per group
  computes the whole prompt, the others its last position (the engine's call once the prompt is cached).
- ``sample``: the engine's sampler on ``[span, V]`` logits.
- ``prefill attention``: one layer's attention kernel on the turn's jobs, at several launch configs.

``--kv-dtype fp8``: the K/V cache in float8 e4m3 (half the bytes each decode step reads per cached position).
Each case is also profiled (``--profile``): operator and kernel tables by GPU and by CPU time beside ``--out``.

Usage (GPU): python -m benchmarks.runner --out $OUT/runner.json --profile
On the CPU (``--shape tiny``, small sizes, ``TRITON_INTERPRET=1``) it runs as a smoke run: its times say only that
the script runs.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Callable

import torch
from benchmarks.common import (DEVICE, QWEN3_VOCAB, SHAPES, build_random_model, copy_bandwidth, qwen3_config,
                               random_adapter, require_kernels, sync)

from skyrl_clora.lora.layers import write_slot
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.model_runner import ModelRunner, PrefillJob
from skyrl_clora.sampler.sampling import sample_rows


def timed_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls, each between CUDA events (after one warm-up); on the
    CPU by the wall clock."""
    fn()
    times = []
    for _ in range(repeats):
        if DEVICE != "cuda":
            started = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - started))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def profile_to(path: Path, fn: Callable[[], object], calls: int) -> None:
    """Writes the operator tables (by self GPU time, then by self CPU time; on the CPU by self CPU time) of
    ``calls`` calls of ``fn`` to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        sync()
    keys = ("self_cuda_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",)
    tables = [prof.key_averages().table(sort_by=key, row_limit=45) for key in keys]
    path.write_text(f"{calls} calls\n" + "\n".join(tables))


def decode_rows(span: int, samples: int, prompt: int, context: int, rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    """Per row: its position (length - 1), the row holding its group's prefix, and the prefix length."""
    positions = [rng.randint(prompt + 1, context) - 1 for _ in range(span)]
    sources = [row - row % samples for row in range(span)]
    return positions, sources, [prompt] * span


def copy_group_prefixes(runner: ModelRunner, span: int, samples: int, prompt: int) -> None:
    """Gives every row of a group the first row's first ``prompt`` positions (as the engine's prefix copies do)."""
    for source in range(0, span, samples):
        kv = runner.read_kv(source, 0, prompt)
        for row in range(source + 1, min(source + samples, span)):
            runner.write_kv(row, 0, kv)


def run_decode(runner: ModelRunner, args: argparse.Namespace, weight_bytes: int, kv_token_bytes: int,
               bandwidth: float, rng: random.Random) -> list[dict]:
    """Decode steps with and without shared-prefix reads at every span (on CUDA graphs captured for both forms)."""
    results = []
    forms = {}
    for share in (False, True):
        runner.share_prefix_reads = share
        runner._graphs.clear()
        if DEVICE == "cuda":
            runner.capture_graphs()
        forms[share] = dict(runner._graphs)
    for span in args.spans:
        positions, sources, lens = decode_rows(span, args.samples, args.prompt, args.context, rng)
        slots = [row % args.tenants for row in range(span)]
        runner.set_decode_inputs([1] * span, positions, slots, sources, lens)
        copy_group_prefixes(runner, span, args.samples, args.prompt)
        own_kv = sum(p + 1 for p in positions) * kv_token_bytes
        shared_kv = own_kv - sum(n for row, (s, n) in enumerate(zip(sources, lens)) if s != row) * kv_token_bytes
        row = {"case": "decode", "span": span, "mean_length": sum(p + 1 for p in positions) / span}
        for share in (False, True):
            runner.share_prefix_reads, runner._graphs = share, forms[share]
            name = "shared" if share else "own"
            row[f"{name}_ms"] = timed_ms(lambda: runner.decode(span), args.repeats)
            row[f"{name}_roofline_ms"] = 1e3 * (weight_bytes + (shared_kv if share else own_kv)) / bandwidth
            if args.profile:
                profile_to(args.out.with_suffix(f".decode{span}.{name}.txt"), lambda: runner.decode(span), 10)
        logits = torch.randn(span, QWEN3_VOCAB, device=runner.device, dtype=runner.dtype)  # what decode returns
        uniform = [rng.random() for _ in range(span)]
        row["sample_ms"] = timed_ms(lambda: sample_rows(logits, [1.0] * span, [1.0] * span, uniform), args.repeats)
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def run_prefill(runner: ModelRunner, args: argparse.Namespace, name: str, jobs: list[PrefillJob]) -> dict:
    """Times (wall, synchronised: the engine waits for the logits) and profiles one ``runner.prefill(jobs)``,
    eager and (on CUDA) replayed from CUDA graphs, side by side."""
    def call() -> None:
        runner.prefill(jobs)
        sync()

    computed = sum(job.tokens.shape[0] - job.start for job in jobs)
    row = {"case": name, "jobs": len(jobs), "computed_positions": computed}
    for graphs in (False, True) if DEVICE == "cuda" else (False,):
        runner.prefill_graphs = graphs
        call()  # warm-up (with graphs: the capture)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            call()
            times.append(1e3 * (time.perf_counter() - started))
        form = "graph" if graphs else "eager"
        row[f"{form}_ms"] = sorted(times)[len(times) // 2]
        if args.profile:
            profile_to(args.out.with_suffix(f".{name.replace(' ', '_')}.{form}.txt"), call, 3)
    print(json.dumps(row), flush=True)
    return row


def run_prefill_attention(runner: ModelRunner, args: argparse.Namespace, jobs: list[PrefillJob]) -> dict:
    """One layer's ``prefill_attention`` for ``jobs`` (a turn's new positions over their histories in the
    cache) at each of ``--attention-configs``, GPU time by CUDA events."""
    from skyrl_clora.kernels.attention.prefill import PrefillConfig, prefill_attention_triton

    counts = [job.tokens.shape[0] - job.start for job in jobs]
    offsets = [sum(counts[:i]) for i in range(len(jobs))]
    rows, starts, q_offsets, q_lens = (torch.tensor(v, device=runner.device) for v in
                                       ([job.row for job in jobs], [job.start for job in jobs], offsets, counts))
    q = torch.randn(sum(counts), runner.num_heads, runner.head_dim, device=runner.device, dtype=runner.dtype)
    k_cache, v_cache = runner.k_cache[0], runner.v_cache[0]
    row = {"case": "prefill attention, one layer", "jobs": len(jobs), "tokens": sum(counts)}
    for name in args.attention_configs:
        block_q, block_n, warps, stages = (int(part) for part in name.split("/"))
        config = PrefillConfig(block_q=block_q, block_n=block_n, num_warps=warps, num_stages=stages)
        row[f"{name}_us"] = 1e3 * timed_ms(lambda: prefill_attention_triton(
            q, k_cache, v_cache, rows, starts, q_offsets, q_lens, runner.head_dim ** -0.5, config), args.repeats)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--spans", type=int, nargs="+", default=[64, 320, 512])
    parser.add_argument("--samples", type=int, default=8, help="rows per GRPO group (sharing a prompt)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--context", type=int, default=520, help="longest decode length (prompt + turns so far)")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--history", type=int, default=388)
    parser.add_argument("--observation", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--attention-configs", nargs="+", default=["32/64/4/2", "64/64/8/2"],
                        help="prefill attention kernel configs timed alone on a turn: block_q/block_n/warps/stages")
    parser.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto",
                        help="the K/V cache's dtype: the model's (auto) or float8 e4m3 (scale 1.0)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    require_kernels()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    bandwidth = copy_bandwidth()
    model = build_random_model(qwen3_config(args.shape), DEVICE)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else model.dtype
    kv_token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * kv_dtype.itemsize
    routing, layers = attach_engine_lora(model, num_slots=args.tenants, max_rank=16)
    for slot in range(args.tenants):
        write_slot(layers, slot, random_adapter(layers, 16, seed=slot))
    num_rows = max(max(args.spans), args.jobs)
    max_len = -(-max(args.context, args.history + args.observation + 1) // 128) * 128
    runner = ModelRunner(model, num_rows=num_rows, max_len=max_len, block_size=128, prefill_tokens=64 * 128,
                         kv_dtype=kv_dtype)
    results = {"shape": args.shape, "kv_dtype": str(kv_dtype), "copy_bandwidth_GBps": bandwidth / 1e9, "cases": []}
    results["cases"] += run_decode(runner, args, weight_bytes, kv_token_bytes, bandwidth, rng)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, QWEN3_VOCAB, (n,), device=runner.device)

    turn = [PrefillJob(row, tokens(args.history + args.observation + 1), row % args.tenants, start=args.history)
            for row in range(args.jobs)]
    results["cases"].append(run_prefill(runner, args, "prefill turn", turn))
    results["cases"].append(run_prefill_attention(runner, args, turn))
    prompt = []
    for row in range(args.jobs):
        first = row % args.samples == 0
        prompt.append(PrefillJob(row, tokens(args.prompt), row % args.tenants, start=0 if first else args.prompt - 1))
    results["cases"].append(run_prefill(runner, args, "prefill prompt", prompt))
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
