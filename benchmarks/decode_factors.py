"""Decode steps under the long-tailed e2e's conditions, one factor at a time: which of them makes a decode step in
``benchmarks.e2e`` slower than the same rows in ``benchmarks.interference``.

The model is built as the embedded backend builds it (``share_base_weights``: fused projections, ``--tenants``
inference LoRA slots of rank 16 holding random adapters); the rows are the long-tailed e2e's (positions drawn as
``benchmarks.interference.decode_rows`` draws them: ``--rows`` rows, each GRPO group of ``--samples`` rows in one
adapter's slot). Each decode step is launched and read as the engine does (one step in flight, on a thread of its
own with a stream at ``--stream-priority``: ``benchmarks.interference.DecodeThread``); a step's GPU time is the
forward pass's alone, between CUDA events after its inputs are staged (as ``EngineStats.decode_gpu_seconds``), and
its period is the host time between consecutive steps' token reads.

The baseline is ``benchmarks.interference``'s decode: a runner of exactly the rows rounded up to 16 (its graph that
size), the rows packed at the front, every GRPO group reading its prompt's ``--prompt`` positions once through one
member (``share_prefix_reads``), each row's blocks its own and consecutive, inputs and block tables written once.
Each other case changes one factor to the e2e's (``e2e``: all of them):

- ``bucket``: the engine's row count ``--num-rows`` (the N=8 e2e's 8 x 64 = 512): graphs captured for
  ``decode_buckets(num_rows)``, so the packed rows replay the smallest bucket at least their span (200 rows: 256);
- ``span``: the rows spread at random over cache rows ``0..--span - 1`` (the highest one running), each batch
  position running its own cache row, as the engine ran them before it packed the running rows at the front of
  the batch: a request takes the lowest free row and the decode span ran to the highest running one, so a long
  episode admitted high kept the span (and the graph) wide while rows below it finished; the rows in between
  run as idle rows (token 0 at position 0, no adapter) through every GEMM;
- ``own``: only ``--shared-fraction`` of the GRPO groups read their prompt through one member (in the e2e only
  first turns do: a later turn's row starts with its own history, whose identity no other row holds), the other
  rows read all their positions from their own block tables;
- ``paged``: the blocks at random places in a pool of ``--pool-blocks`` (the e2e's KV pool after churn), each GRPO
  group's prompt blocks held by reference by all its rows (the prefix cache), the rest each row's own;
- ``inputs``: the engine's per-step staging: the block tables uploaded, the decode inputs written (tokens taken
  from the step in flight's draw on the device, positions advancing by one, cycling over ``--advance`` steps),
  the running rows' index and sampling draws copied, every step;
- ``gil``: ``--gil-threads`` Python threads busy beside the decode thread (the tenant loops' and trainer's host
  work taking the GIL; the decode thread at the engine's switch interval).

Reported per case: the rows, span, graph bucket and key positions read through another row's blocks per step (the
e2e prints these as ``shared_prefix_positions`` per step), mean and median step period and forward GPU time, and
each against the baseline. Prints a table; writes ``decode_factors.json`` under ``--out``.

Usage (GPU): python -m benchmarks.decode_factors --shape qwen3-1.7b --out $OUT
On the CPU (``--shape tiny``, small sizes, ``TRITON_INTERPRET=1``) it runs as a smoke run: its figures say only that
the script runs (shared-prefix reads are a CUDA path; the CPU reads every row's own table).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from benchmarks.common import (DEVICE, SHAPES, build_random_model, device_name, qwen3_config, random_adapter,
                               require_kernels, sync, warm_up)
from benchmarks.interference import DecodeThread, Episodes, decode_rows, periods_ms
from benchmarks.workloads import parse_lengths

from skyrl_clora.backends.embedded.services import share_base_weights
from skyrl_clora.device.staging import lists_to_device
from skyrl_clora.lora.layers import write_slot
from skyrl_clora.sampler.engine_config import STREAM_PRIORITIES
from skyrl_clora.sampler.model_runner import DECODE_ROW_QUANTUM, ModelRunner, decode_buckets
from skyrl_clora.sampler.sampling import DrawnTokens, draw_rows, request_uniforms
from skyrl_clora.sampler.shared_rows import SharedPrefixRows

RANK = 16
BLOCK = 128  # the engine's K/V block (sampler.prefill_block in the e2e runs)
CASES = ("baseline", "bucket", "span", "own", "paged", "inputs", "gil", "e2e")


def quantum(rows: int) -> int:
    """``rows`` rounded up to whole decode row quanta."""
    return -(-rows // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM


@dataclass(frozen=True)
class Factors:
    """One case's decode conditions: the runner's rows (None: the rows rounded up to 16), the highest running row
    + 1 (None: rows packed at the front), the share of GRPO groups reading their prompt through one member, blocks
    scattered over the pool with prompts held by reference, inputs staged every step, busy Python threads."""

    num_rows: int | None = None
    span: int | None = None
    shared_fraction: float = 1.0
    paged: bool = False
    per_step_inputs: bool = False
    gil_threads: int = 0


def case_factors(name: str, args: argparse.Namespace) -> Factors:
    """The factors of case ``name`` (one of :data:`CASES`) at ``args``' e2e settings."""
    e2e = {"bucket": {"num_rows": args.num_rows}, "span": {"num_rows": args.num_rows, "span": args.span},
           "own": {"shared_fraction": args.shared_fraction}, "paged": {"paged": True},
           "inputs": {"per_step_inputs": True}, "gil": {"gil_threads": args.gil_threads}}
    if name == "baseline":
        return Factors()
    if name == "e2e":
        merged: dict = {}
        for change in e2e.values():
            merged.update(change)
        return Factors(**merged)
    return Factors(**e2e[name])


@dataclass
class Layout:
    """Where ``len(rows)`` running rows sit: their cache rows (ascending) over a runner of ``num_rows`` rows, their
    positions, LoRA slots and GRPO groups; the span a step runs; per row of the span its shared-prefix source row
    and length; the block tables ``[num_rows + 1, max_len // BLOCK]`` over ``num_blocks`` pool blocks; the key
    positions a step reads through another row's blocks."""

    num_rows: int
    rows: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    span: int
    prefix_rows: list[int]
    prefix_lens: list[int]
    tables: np.ndarray
    num_blocks: int
    borrowed: int


def make_layout(positions: list[int], factors: Factors, prompt: int, samples: int, tenants: int, max_len: int,
                advance: int, pool_blocks: int, rng: random.Random) -> Layout:
    """The rows of ``positions`` placed as ``factors`` says (see the module docstring); each row has blocks up to
    its position + ``advance`` (the positions it reaches while stepping). Raises ValueError when the span or pool
    cannot hold them."""
    count = len(positions)
    num_rows = factors.num_rows or quantum(count)
    span = factors.span or quantum(count)
    if not count <= span <= num_rows or span % DECODE_ROW_QUANTUM:
        raise ValueError(f"span {span} must be a multiple of {DECODE_ROW_QUANTUM} in [{count}, {num_rows}]")
    if factors.span is None:
        rows = np.arange(count)
    else:  # the highest row runs (it sets the span); the others anywhere below it
        rows = np.array(sorted(rng.sample(range(span - 1), count - 1)) + [span - 1])
    groups = np.arange(count) // samples
    slots = groups % tenants
    per_row = max_len // BLOCK
    if max(positions) + advance > max_len:
        raise ValueError(f"positions up to {max(positions)} + --advance {advance} exceed max_len {max_len}")
    needed = [(p + advance - 1) // BLOCK + 1 for p in positions]
    prompt_blocks = prompt // BLOCK  # whole prompt blocks: those the prefix cache keys and rows share by reference
    group_count = int(groups[-1]) + 1
    if factors.paged:
        own = sum(n - prompt_blocks for n in needed) + group_count * prompt_blocks
        if own > pool_blocks:
            raise ValueError(f"the rows need {own} blocks; --pool-blocks is {pool_blocks}")
        free = rng.sample(range(pool_blocks), own)
        group_prompt = [[free.pop() for _ in range(prompt_blocks)] for _ in range(group_count)]
        blocks = [group_prompt[g] + [free.pop() for _ in range(n - prompt_blocks)] for g, n in zip(groups, needed)]
    else:
        starts = np.concatenate([[0], np.cumsum(needed)])
        blocks = [list(range(int(starts[i]), int(starts[i + 1]))) for i in range(count)]
        pool_blocks = max(pool_blocks, int(starts[-1]))
    tables = np.full((num_rows + 1, per_row), pool_blocks, dtype=np.int32)  # other entries: the scratch block
    for row, row_blocks in zip(rows, blocks):
        tables[row, : len(row_blocks)] = row_blocks
    sharing = set(rng.sample(range(group_count), round(factors.shared_fraction * group_count)))
    shared = SharedPrefixRows(num_rows)
    for row, group in zip(rows.tolist(), groups.tolist()):
        if group in sharing and prompt_blocks:
            shared.assign(row, ((group,), prompt_blocks * BLOCK))
    prefix_rows, prefix_lens = shared.sources(np.arange(span), span)  # batch position i runs cache row i
    return Layout(num_rows, rows, np.asarray(positions, dtype=np.int64), slots, span, prefix_rows, prefix_lens,
                  tables, pool_blocks, shared.borrowed_positions)


class EngineSteps:
    """Decode steps of ``layout`` on ``runner``, launched as the engine launches them (``launch`` for
    :class:`benchmarks.interference.DecodeThread`): inputs written once, or with ``per_step`` every step as
    ``Engine._launch_decode`` stages them."""

    def __init__(self, runner: ModelRunner, layout: Layout, per_step: bool, advance: int) -> None:
        self.runner, self.layout, self.per_step, self.advance = runner, layout, per_step, advance
        self.count = len(layout.rows)
        self.seeds = np.arange(1, self.count + 1, dtype=np.uint64)
        self.steps = 0
        runner.set_block_tables(layout.tables)
        self._stage(np.zeros(layout.span, dtype=bool))
        self.rows_device = lists_to_device([layout.rows], runner.device)[0]

    def _stage(self, pending: np.ndarray) -> None:
        """Writes the span's decode inputs: running rows at their position (+ the steps taken, cycling over
        ``advance``), idle rows token 0 at position 0 with no adapter; ``pending`` rows take their token from the
        last draw on the device."""
        layout, span = self.layout, self.layout.span
        tokens, positions, slots = np.ones(span, dtype=np.int64), np.zeros(span, dtype=np.int64), np.full(span, -1)
        positions[layout.rows] = layout.positions + self.steps % self.advance
        slots[layout.rows] = layout.slots
        self.runner.set_decode_inputs(tokens, positions, slots, layout.prefix_rows, layout.prefix_lens,
                                      from_sampled=pending if pending.any() else None)

    def launch(self) -> tuple[DrawnTokens, torch.cuda.Event | None, torch.cuda.Event | None]:
        """Launches one step (staging its inputs first with ``per_step``) and its sampling; returns its tokens (being
        copied to the host) and the CUDA events around its forward pass (None on the CPU)."""
        layout = self.layout
        if self.per_step:
            self.steps += 1
            self.runner.set_block_tables(layout.tables)
            pending = np.zeros(layout.span, dtype=bool)
            pending[layout.rows] = True
            self._stage(pending)
            self.rows_device = lists_to_device([layout.rows], self.runner.device)[0]
        cuda = self.runner.device.type == "cuda"
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = self.runner.decode(layout.span)
        if cuda:
            end.record()
        ones = np.ones(self.count, dtype=np.float32)
        drawn = draw_rows(logits.index_select(0, self.rows_device), ones, ones,
                          request_uniforms(self.seeds, np.full(self.count, self.steps)))
        self.runner.record_sampled(self.rows_device, drawn.tokens)
        return drawn, start, end


class BusyThreads:
    """``count`` daemon threads doing pure-Python work (holding the GIL whenever they run) until :meth:`stop`."""

    def __init__(self, count: int) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            sum(range(1000))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The engine's model: fused projections with ``args.tenants`` inference slots holding random rank-16 adapters
    (``share_base_weights``, as the embedded backend builds it)."""
    model = build_random_model(qwen3_config(args.shape), DEVICE)
    sampler_layers = share_base_weights(model, args.tenants, 2, RANK)[0]
    for slot in range(args.tenants):
        write_slot(sampler_layers, slot, random_adapter(sampler_layers, RANK, seed=slot))
    return model


def measure(model: torch.nn.Module, layout: Layout, factors: Factors, args: argparse.Namespace) -> dict:
    """One case: a runner for ``layout`` (graphs captured on CUDA), 10 warm-up steps, then ``args.steps`` steps
    (beside ``factors.gil_threads`` busy threads); its figures and every step."""
    runner = ModelRunner(model, num_rows=layout.num_rows, max_len=args.max_len, block_size=BLOCK,
                         prefill_tokens=BLOCK, num_blocks=layout.num_blocks, share_prefix_reads=DEVICE == "cuda")
    steps = EngineSteps(runner, layout, factors.per_step_inputs, args.advance)
    if DEVICE == "cuda":
        runner.capture_graphs()
    DecodeThread(steps, args.stream_priority, count=10).join()
    busy = BusyThreads(factors.gil_threads)
    try:
        records = DecodeThread(steps, args.stream_priority, count=args.steps).join()
    finally:
        busy.stop()
    del runner, steps
    gc.collect()  # the runner's KV pool and graphs go before the next case's
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    periods = periods_ms(records)
    gpu = [s.gpu_ms for s in records if s.gpu_ms is not None]
    bucket = next(b for b in decode_buckets(layout.num_rows) if b >= layout.span)
    return {"factors": asdict(factors), "rows": len(layout.rows), "num_rows": layout.num_rows, "span": layout.span,
            "graph_rows": bucket if DEVICE == "cuda" else layout.span, "borrowed_positions": layout.borrowed,
            "period_ms": statistics.mean(periods), "period_median_ms": statistics.median(periods),
            "gpu_ms": statistics.mean(gpu) if gpu else None, "gpu_median_ms": statistics.median(gpu) if gpu else None,
            "steps": [asdict(s) for s in records]}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--rows", type=int, default=200,
                        help="running rows (benchmarks.interference's 200, drawn alike; the N=8 e2e ran 192 a step)")
    parser.add_argument("--num-rows", type=int, default=512, help="the engine's rows (bucket, span): tenants x 64")
    parser.add_argument("--span", type=int, default=512, help="the highest running row + 1 (span)")
    parser.add_argument("--shared-fraction", type=float, default=0.375,
                        help="GRPO groups reading their prompt through one member (own; 9 of 200 rows' 25 groups "
                             "read 16,128 positions a step through another row, the e2e 16,446)")
    parser.add_argument("--pool-blocks", type=int, default=4096, help="KV pool blocks (paged; the e2e's plan: 4,096)")
    parser.add_argument("--gil-threads", type=int, default=1, help="busy Python threads (gil)")
    parser.add_argument("--lengths", default="longtail", metavar="SPEC", help="each turn's length (benchmarks.e2e's)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--observation", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per tenant step (the rows' positions' pool)")
    parser.add_argument("--samples", type=int, default=8, help="rows per GRPO group")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1920,
                        help="the rows' length limit (the long-tailed e2e's: 256 + 2 x (512 + 32) + 512, whole blocks)")
    parser.add_argument("--advance", type=int, default=16, help="positions a row steps through, cycling (inputs)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stream-priority", choices=sorted(STREAM_PRIORITIES), default="high")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        episodes = Episodes(parse_lengths(args.lengths), args.prompt, args.turns, args.observation)
    except ValueError as error:
        parser.error(str(error))
    if args.max_len % BLOCK or not 0.0 <= args.shared_fraction <= 1.0 or args.steps < 2 or args.advance < 1:
        parser.error(f"--max-len must be a multiple of {BLOCK}, --shared-fraction in [0, 1], --steps >= 2, "
                     "--advance >= 1")
    require_kernels()
    args.out.mkdir(parents=True, exist_ok=True)
    positions = decode_rows(episodes, args.rows, None, args.tenants, args.prompts * args.samples, random.Random(0))
    positions = [min(p, args.max_len - args.advance) for p in positions]
    model = build_model(args)
    print(f"{args.shape} on {device_name()}: {args.rows} decode rows, positions mean {statistics.mean(positions):.0f} "
          f"max {max(positions)}", flush=True)
    warm_up()
    results = {}
    for name in args.cases:
        factors = case_factors(name, args)
        try:
            layout = make_layout(positions, factors, args.prompt, args.samples, args.tenants, args.max_len,
                                 args.advance, args.pool_blocks, random.Random(1))
        except ValueError as error:
            parser.error(f"case {name}: {error}")
        results[name] = measure(model, layout, factors, args)
        row = results[name]
        print(f"{name}: period {row['period_ms']:.2f} ms, GPU {row['gpu_ms'] or 0:.2f} ms", flush=True)
        sync()
    (args.out / "decode_factors.json").write_text(json.dumps(
        {"device": device_name(), "shape": args.shape, "args": {k: str(v) for k, v in vars(args).items()},
         "decode_positions": positions, "cases": results}, indent=1) + "\n")
    print_table(results)


def print_table(results: dict[str, dict]) -> None:
    """Each case's layout, mean step period and forward GPU time, and each against the baseline (when run)."""
    base = results.get("baseline")
    print(f"\n{'case':9} {'rows':>5} {'span':>5} {'graph':>5} {'shared pos':>10} {'period ms':>9} {'GPU ms':>7} "
          f"{'x base':>7} {'GPU x base':>10}")
    for name, row in results.items():
        gpu = "-" if row["gpu_ms"] is None else f"{row['gpu_ms']:.2f}"
        ratio = "" if base is None else f"{row['period_ms'] / base['period_ms']:.2f}x"
        gpu_ratio = "" if base is None or row["gpu_ms"] is None else f"{row['gpu_ms'] / base['gpu_ms']:.2f}x"
        print(f"{name:9} {row['rows']:5} {row['span']:5} {row['graph_rows']:5} {row['borrowed_positions']:10} "
              f"{row['period_ms']:9.2f} {gpu:>7} {ratio:>7} {gpu_ratio:>10}")


if __name__ == "__main__":
    main()
