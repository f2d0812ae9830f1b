"""Decode and training on one GPU, each alone and side by side: how much each slows the other, and training MFU.

One model (a Qwen3 ``--shape`` with random bf16 weights) is built as the embedded backend builds it
(``backends.embedded.services.share_base_weights``: the engine's fused projections with ``--tenants`` inference LoRA slots, the
trainer's module tree on the same weight tensors with two trainable slots, swap mode). Measured in one run, in order:

- (a) decode alone: ``--steps`` decode steps of ``--rows`` rows (the engine's CUDA-graph decode, its sampler, the
  tokens copied to the host), on a thread of their own with one step in flight as the engine runs them (its stream at
  ``--stream-priority``, its GIL switch interval);
- (c) a training pass alone: ``--passes`` GRPO passes (``Trainer.train_step``, tenants in turn) on one tenant step's
  batch, on the calling thread's default stream (where the scheduler's worker threads run them);
- (b, d) both at once: the decode thread steps continuously while the same ``--passes`` passes run (never paused:
  the e2e's scheduler pauses sampling only for passes that start while ``clora.pause_sampling_rows`` rows decode).

Decode rows are what a long-tailed e2e step keeps running: each row's position is drawn uniformly from every decode
step of the episodes of ``benchmarks.e2e`` at ``--lengths`` (prompt ``--prompt``, ``--turns`` turns with
``--observation``-token tool results between them; a long turn holds its row for more steps), or with ``--context N``
each row's length (position + 1) uniformly from ``[prompt + 1, N]`` as in ``benchmarks.runner``; row ``i`` uses slot
``i % --tenants`` and reads its first ``--prompt`` positions from its group of ``--samples`` rows' first row (the
engine's shared-prefix reads, on CUDA). The training batch is one tenant step of the same episodes: ``--prompts`` x
``--samples`` rows.

Decode steps are timed by CUDA events around each step on the decode stream (its GPU span: waiting for SMs the
training kernels hold included) and by the host clock between consecutive steps' token reads (the step period the
engine sees); "beside" counts the steps launched and read inside a pass. Passes are timed by the host clock around
the call, which ends in the pass's host synchronisation (as ``TrainScheduler.pass_intervals``). Reported: medians,
the slowdowns b/a and d/c, and the overlapped phase's wall against the sum of its parts at the speed each has alone
(its passes x the pass alone + its decode steps x the step period alone). Each pass's MFU is its FLOP
(:func:`benchmarks.common.train_pass_flop`) over its time and ``--peak-tflops``. Prints a table; writes
``interference.json`` under ``--out`` with every step and pass.

Usage (GPU): python -m benchmarks.interference --shape qwen3-1.7b --out $OUT
On the CPU (``--shape tiny``, small sizes, ``TRITON_INTERPRET=1``) it runs as a smoke run: its figures say only that
the script runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from skyrl.train.config import AlgorithmConfig
from benchmarks.common import (DEVICE, H200_BF16_TFLOPS, SHAPES, build_random_model, device_name, qwen3_config,
                               random_adapter, require_kernels, sync, train_pass_flop, warm_up)
from benchmarks.workloads import Lengths, counter_rng, parse_lengths

from skyrl_clora.backends.embedded.services import carve_gemm_sms, share_base_weights
from skyrl_clora.device.cuda_settings import avoid_cudnn_attention
from skyrl_clora.lora.layers import write_slot
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.engine_config import STREAM_PRIORITIES
from skyrl_clora.sampler.engine_thread import GIL_SWITCH_SECONDS
from skyrl_clora.sampler.model_runner import DECODE_ROW_QUANTUM, ModelRunner
from skyrl_clora.sampler.sampling import DrawnTokens, draw_rows
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings

RANK = 16
BLOCK = 128  # the engine's K/V block (sampler.prefill_block in the e2e runs)


@dataclass(frozen=True)
class Episodes:
    """The e2e's episode shape: ``prompt``-token prompts, ``turns`` turns of lengths drawn from ``lengths``,
    ``observation`` tokens between turns."""

    lengths: Lengths
    prompt: int
    turns: int
    observation: int

    def turn_lengths(self, seed: int, episode: int) -> list[int]:
        """Episode ``episode`` of step 1 of the tenant seeded ``seed``: its turns' lengths (as benchmarks.e2e draws)."""
        return [self.lengths.draw(seed, 1, episode, turn) for turn in range(self.turns)]

    def decode_positions(self, seed: int, episode: int) -> list[int]:
        """The positions of the episode's decode steps, one per step: a turn's first token comes from its prefill,
        the other ``length - 1`` from decode steps at the positions after its context."""
        positions, context = [], self.prompt
        for turn, length in enumerate(self.turn_lengths(seed, episode)):
            positions += range(context, context + length - 1)
            context += length + (self.observation if turn + 1 < self.turns else 0)
        return positions


def decode_rows(episodes: Episodes, rows: int, context: int | None, tenants: int, per_tenant: int,
                rng: random.Random) -> list[int]:
    """Each decode row's position: drawn from every decode step of ``per_tenant`` episodes of each of ``tenants``
    tenants (time-weighted: a row runs one step per step), or with ``context`` uniformly from
    ``[prompt, context - 1]``."""
    if context is not None:
        return [rng.randint(episodes.prompt, context - 1) for _ in range(rows)]
    pool = [p for seed in range(1, tenants + 1) for episode in range(per_tenant)
            for p in episodes.decode_positions(seed, episode)]
    return rng.choices(pool, k=rows)


def step_batch(episodes: Episodes, prompts: int, samples: int, seed: int) -> TrainBatch:
    """One tenant step of e2e episodes: ``prompts`` x ``samples`` rows, responses of sampled turns (loss mask 1) and
    observations (0), random tokens and rewards."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids, responses, masks, groups = [], [], [], []
    for index in range(prompts * samples):
        if index % samples == 0:
            prompt = torch.randint(0, 1000, (episodes.prompt,), generator=generator).tolist()
        response, mask = [], []
        for turn, length in enumerate(episodes.turn_lengths(seed, index)):
            response += torch.randint(0, 1000, (length,), generator=generator).tolist()
            mask += [1] * length
            if turn + 1 < episodes.turns:
                response += counter_rng(seed, 1, index, turn, 1).integers(0, 1000, episodes.observation).tolist()
                mask += [0] * episodes.observation
        prompt_ids.append(prompt)
        responses.append(response)
        masks.append(mask)
        groups.append(f"p{index // samples}")
    rewards = torch.rand(len(responses), generator=generator).round().tolist()
    return TrainBatch(prompt_ids=prompt_ids, response_ids=responses, loss_masks=masks, rewards=rewards,
                      group_ids=groups, rollout_logprobs=None)


class DecodeSteps:
    """Decode steps of ``positions`` (one row each) on ``runner``, launched and read as the engine does: the next
    step launched before the last one's tokens are read."""

    def __init__(self, runner: ModelRunner, positions: list[int], tenants: int, samples: int, prompt: int) -> None:
        self.runner = runner
        self.span = runner.num_rows
        rows = len(positions)
        padded = positions + [0] * (self.span - rows)  # rows past ``rows`` idle at position 0 (outputs unread)
        slots = [row % tenants if row < rows else -1 for row in range(self.span)]
        sources = [row - row % samples for row in range(self.span)]
        prefix_lens = [prompt if row < rows else 0 for row in range(self.span)]
        runner.set_decode_inputs([1] * self.span, padded, slots, sources, prefix_lens)
        self.rows = np.arange(rows)
        self.rows_device = torch.arange(rows, device=runner.device)
        self.rng = random.Random(0)

    def launch(self) -> tuple[DrawnTokens, torch.cuda.Event | None, torch.cuda.Event | None]:
        """Launches one step and its sampling; returns its tokens (being copied to the host) and its start and end
        events (None on the CPU)."""
        cuda = self.runner.device.type == "cuda"
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = self.runner.decode(self.span)
        count = len(self.rows)
        drawn = draw_rows(logits.index_select(0, self.rows_device), [1.0] * count, [1.0] * count,
                          [self.rng.random() for _ in range(count)])
        self.runner.record_sampled(self.rows_device, drawn.tokens)
        if cuda:
            end.record()
        return drawn, start, end


@dataclass
class Step:
    """One decode step: host times of its launch and of its tokens' read; its GPU milliseconds (events; None on
    the CPU)."""

    launched: float
    read: float
    gpu_ms: float | None = None


class DecodeThread:
    """Runs :class:`DecodeSteps` on a thread of its own, as the engine thread does (on CUDA: its own stream at
    ``priority``, the engine's GIL switch interval), until ``steps`` steps are read or :meth:`stop`."""

    def __init__(self, steps: DecodeSteps, priority: str, count: int | None = None) -> None:
        self.decode, self.priority, self.count = steps, priority, count
        self.records: list[Step] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream = None
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # the inputs written on the default stream are ready
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_SECONDS))
            stream = torch.cuda.Stream(priority=STREAM_PRIORITIES[self.priority])
        events = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            in_flight, launches = None, 0
            while not self._stop.is_set() and (self.count is None or launches < self.count):
                launches += 1
                launched = time.perf_counter()
                drawn, start, end = self.decode.launch()
                if in_flight is not None:
                    self._read(*in_flight, events)
                in_flight = (launched, drawn, start, end)
            if in_flight is not None:
                self._read(*in_flight, events)
        for record, (start, end) in zip(self.records, events):
            if start is not None:
                record.gpu_ms = start.elapsed_time(end)

    def _read(self, launched: float, drawn: DrawnTokens, start, end, events: list) -> None:
        drawn.result()
        self.records.append(Step(launched, time.perf_counter()))
        events.append((start, end))

    def wait_for(self, steps: int) -> None:
        """Returns once ``steps`` steps are read (or the thread ended)."""
        while len(self.records) < steps and self._thread.is_alive():
            time.sleep(1e-3)

    def join(self) -> list[Step]:
        """Waits for the thread to end (it must have a ``count``); returns every step read."""
        self._thread.join()
        return self.records

    def stop(self) -> list[Step]:
        """Stops after the step in flight; returns every step read."""
        self._stop.set()
        return self.join()


def periods_ms(steps: list[Step]) -> list[float]:
    """Milliseconds between consecutive steps' token reads."""
    return [1e3 * (b.read - a.read) for a, b in zip(steps, steps[1:])]


def run_passes(trainer: Trainer, tenants: list[str], batch: TrainBatch, count: int) -> list[tuple[float, float]]:
    """``count`` swap-mode passes on ``batch``, tenants in turn; each pass's host ``(start, end)``."""
    intervals = []
    for index in range(count):
        started = time.perf_counter()
        trainer.train_step(tenants[index % len(tenants)], batch)
        intervals.append((started, time.perf_counter()))
    return intervals


def median(values: list[float]) -> float | None:
    """The median (None for no values: GPU times on the CPU)."""
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, None when either is missing (no decode step fell inside a pass on a busy CPU)."""
    return None if numerator is None or denominator is None else numerator / denominator


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, Trainer, list[str]]:
    """The engine's model (fused projections, inference slots holding random adapters) and the trainer on its weights
    (services' layout) with ``args.tenants`` tenants registered; their names."""
    model = build_random_model(qwen3_config(args.shape), DEVICE)
    sampler_layers, trainer_model, routing, trainer_layers = share_base_weights(model, args.tenants, 2, RANK)
    for slot in range(args.tenants):
        write_slot(sampler_layers, slot, random_adapter(sampler_layers, RANK, seed=slot))
    store = AdapterStore(trainer_layers, num_slots=2)
    names = [f"tenant-{i}" for i in range(args.tenants)]
    for index, name in enumerate(names):
        store.register(name, init_adapter(trainer_layers, RANK, 2.0 * RANK, torch.Generator().manual_seed(index)),
                       LRSchedule(1e-4, 0, 1000, "constant"), seed=index)
    trainer = Trainer(trainer_model, routing, trainer_layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False),
                      OptimizerConfig(), micro_batch_size=32, max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                      shared_prefix=True))
    return model, trainer, names


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--rows", type=int, default=200, help="decode rows (~201 decode in the long-tailed e2e at N=8)")
    parser.add_argument("--lengths", default="longtail", metavar="SPEC",
                        help="each turn's length (benchmarks.e2e's --lengths)")
    parser.add_argument("--context", type=int, metavar="N",
                        help="instead: each row's length uniform in [prompt + 1, N]")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--observation", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per tenant step (the training batch)")
    parser.add_argument("--samples", type=int, default=8, help="rows per prompt")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=300, help="decode steps alone")
    parser.add_argument("--passes", type=int, default=5, help="training passes alone, and again beside decoding")
    parser.add_argument("--stream-priority", choices=sorted(STREAM_PRIORITIES), default="high",
                        help="the decode stream's (sampler.stream_priority)")
    parser.add_argument("--sm-carveout", type=int, default=0,
                        help="SMs the trainer's GEMMs leave free (clora.sm_carveout)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="the MFU's denominator")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    avoid_cudnn_attention()  # the process setting the embedded backend's runs have (build_services)
    try:
        episodes = Episodes(parse_lengths(args.lengths), args.prompt, args.turns, args.observation)
    except ValueError as error:
        parser.error(str(error))
    if args.context is not None and args.context <= args.prompt:
        parser.error(f"--context {args.context} must exceed --prompt {args.prompt}")
    require_kernels()
    args.out.mkdir(parents=True, exist_ok=True)
    model, trainer, names = build(args)
    positions = decode_rows(episodes, args.rows, args.context, args.tenants, args.prompts * args.samples,
                            random.Random(0))
    num_rows = -(-args.rows // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM
    per_row = -(-(max(positions) + 1) // BLOCK)
    used = [position // BLOCK + 1 for position in positions]  # each row its own blocks up to its position
    blocks = sum(used)
    tables = np.full((num_rows + 1, per_row), blocks, dtype=np.int32)  # other entries: the runner's spare block
    for row, count in enumerate(used):
        tables[row, :count] = np.arange(sum(used[:row]), sum(used[:row]) + count)
    runner = ModelRunner(model, num_rows=num_rows, max_len=per_row * BLOCK, block_size=BLOCK,
                         prefill_tokens=64 * BLOCK, num_blocks=blocks, share_prefix_reads=DEVICE == "cuda")
    runner.set_block_tables(tables)
    decode = DecodeSteps(runner, positions, args.tenants, args.samples, args.prompt)
    if DEVICE == "cuda":
        runner.capture_graphs()
        carve_gemm_sms(args.sm_carveout)  # after the decode graphs' capture, as services builds the engine
    batch = step_batch(episodes, args.prompts, args.samples, seed=1)
    flop = train_pass_flop(model.config, RANK, [len(p) for p in batch.prompt_ids],
                           [len(r) for r in batch.response_ids], batch.group_ids, trainer.shared_prefix)
    print(f"{args.shape} on {device_name()}: {args.rows} decode rows, positions mean {statistics.mean(positions):.0f} "
          f"max {max(positions)}; training pass {len(batch.response_ids)} rows, {flop / 1e12:.1f} TFLOP", flush=True)

    warm_up()
    DecodeThread(decode, args.stream_priority, count=10).join()  # warm-up: compiles and caches
    run_passes(trainer, names, batch, 1)
    sync()
    alone = DecodeThread(decode, args.stream_priority, count=args.steps).join()
    passes_alone = run_passes(trainer, names, batch, args.passes)
    beside_thread = DecodeThread(decode, args.stream_priority)
    beside_thread.wait_for(5)
    passes_beside = run_passes(trainer, names, batch, args.passes)
    everything = beside_thread.stop()
    inside = [any(a <= s.launched and s.read <= b for a, b in passes_beside) for s in everything]
    beside = [s for s, flag in zip(everything, inside) if flag]
    window = (passes_beside[0][0], passes_beside[-1][1])
    in_window = [s for s in everything if window[0] <= s.read <= window[1]]

    def pass_row(intervals: list[tuple[float, float]]) -> dict:
        seconds = [b - a for a, b in intervals]
        return {"pass_s": median(seconds), "passes_s": seconds,
                "mfu": [flop / s / (args.peak_tflops * 1e12) for s in seconds]}

    rows = {
        "decode alone": {"period_ms": median(periods_ms(alone)), "steps": len(alone),
                         "gpu_ms": median([s.gpu_ms for s in alone if s.gpu_ms is not None])},
        "decode beside training": {"period_ms": median([p for flag, p in zip(inside[1:], periods_ms(everything))
                                                        if flag]),
                                   "gpu_ms": median([s.gpu_ms for s in beside if s.gpu_ms is not None]),
                                   "steps": len(beside)},
        "pass alone": pass_row(passes_alone),
        "pass beside decoding": pass_row(passes_beside),
    }
    wall = window[1] - window[0]
    parts = args.passes * rows["pass alone"]["pass_s"] + len(in_window) * rows["decode alone"]["period_ms"] / 1e3
    summary = {
        "decode_period_slowdown": ratio(rows["decode beside training"]["period_ms"], rows["decode alone"]["period_ms"]),
        "decode_gpu_slowdown": ratio(rows["decode beside training"]["gpu_ms"], rows["decode alone"]["gpu_ms"]),
        "pass_slowdown": rows["pass beside decoding"]["pass_s"] / rows["pass alone"]["pass_s"],
        "overlapped_wall_s": wall, "sum_of_parts_s": parts, "wall_over_parts": wall / parts,
        "overlapped": f"{args.passes} passes and {len(in_window)} decode steps",
    }
    report = {"device": device_name(), "shape": args.shape, "args": {k: str(v) for k, v in vars(args).items()},
              "decode_positions": positions, "pass_flop": flop, "rows": rows, "summary": summary,
              "steps_alone": [asdict(s) for s in alone], "steps_overlapped": [asdict(s) for s in everything],
              "passes_beside": passes_beside}
    (args.out / "interference.json").write_text(json.dumps(report, indent=1) + "\n")

    print_table(rows, summary)


def print_table(rows: dict[str, dict], summary: dict) -> None:
    """The closing table: each case's medians, then the slowdowns and the overlapped wall against its parts."""
    print(f"\n{'case':24} {'step period ms':>14} {'step GPU ms':>11} {'pass s':>7} {'MFU':>6}")
    for name, row in rows.items():
        if "pass_s" in row:
            print(f"{name:24} {'':>14} {'':>11} {row['pass_s']:7.3f} {median(row['mfu']):6.1%}")
        else:
            gpu = "-" if row["gpu_ms"] is None else f"{row['gpu_ms']:.2f}"
            period = "-" if row["period_ms"] is None else f"{row['period_ms']:.2f}"
            print(f"{name:24} {period:>14} {gpu:>11} {'':>7} {'':>6}")
    gpu_slowdown, wall, parts = summary["decode_gpu_slowdown"], summary["overlapped_wall_s"], summary["sum_of_parts_s"]
    period_slowdown = summary["decode_period_slowdown"]
    print("decode beside training: "
          + ("no step fell inside a pass" if period_slowdown is None else f"{period_slowdown:.2f}x its step period alone")
          + (f", {gpu_slowdown:.2f}x its GPU time" if gpu_slowdown is not None else "")
          + f"; pass beside decoding: {summary['pass_slowdown']:.2f}x alone; overlapped wall {wall:.2f} s vs "
          f"{parts:.2f} s of the same work alone ({summary['overlapped']}): {summary['wall_over_parts']:.2f}x")


if __name__ == "__main__":
    main()
