"""Where an end-to-end group's wall time goes (``benchmarks.e2e``): the GPU-busy fraction and the wall account.

The wall account (:func:`wall_account`) splits one group's wall three ways, each from timers that already run:

- the run: ``setup`` (config and cold start, up to the services being built) and the engine thread's ``life``
  (built to shut down: the tenants' registration, their experiments and the shutdown);
- the engine thread's life, from its counters (:class:`~skyrl_clora.sampler.engine_stats.EngineStats`): decode
  steps (their count, milliseconds each, and rows per step: the tokens decode steps accepted, i.e. every generated
  token but each request's first, which its prefill samples, over the steps), prefill rounds, other busy work
  (publishes applied, admission, the loop's rounds that neither prefilled nor decoded), sampling paused for
  training passes, idle (no runnable row, request or publish), and ``unaccounted``: the life less all of these
  (the loop's own bookkeeping and waits for the GIL between its timed parts);
- the trainer (:class:`~skyrl_clora.trainer.scheduler.TrainPass` records): passes, of them those that paused
  sampling, the rows decoding when passes began (where the scheduler has a sampler), and the trainer idle;
- the run window (first tenant step's start to last step's end) by what ran on the host clock: some tenant's
  rollout in flight and a training pass at once, rollouts only, passes only, neither;
- per tenant, its wall (first step's start to last step's end) as the sum of its steps' phases: ``rollout`` (its
  episodes in flight), ``trainer_queue`` (its train call less its pass: waiting behind other tenants' passes and
  the hand-offs between the event loop and the trainer's thread), ``training`` (its pass, which in packed mode
  it shares), ``publish`` (until the engine applied its adapter) and ``host`` (the rest: building its batch and
  counting its FLOP).

Every figure is host-clock seconds unless its name says otherwise; ``tenant_mean`` averages the tenants' phases.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from skyrl_clora.sampler.engine_stats import EngineStats
from skyrl_clora.trainer.scheduler import TrainPass

GPU_BUSY_METHOD = (
    "GPU busy = union of the engine's GPU time and the trainer's passes over the wall time (cold starts included). "
    "engine: EngineStats decode_gpu_seconds + prefill_gpu_seconds + prefill_copy_gpu_seconds (CUDA events around "
    "each forward pass and block copy; 0 off CUDA); trainer: TrainScheduler.pass_seconds (host time of each pass, "
    "which ends in a host sync: at least its GPU time, with its launch gaps). Adapter publishes are left out. "
    "upper = min(1, (engine + trainer) / wall); lower = max(engine, trainer) / wall; union (CUDA): the measure of "
    "the union of every engine GPU interval (each forward pass's and block copy's start and end events, set on "
    "the host clock by Engine.record_gpu_intervals) and every pass's host interval (TrainScheduler.pass_intervals) "
    "over the wall, between lower and upper; the cold start's GPU work (memory plan pass, graph capture) counts "
    "as idle. The table prints union where measured, else upper.")
TENANT_PHASES = ("rollout", "trainer_queue", "training", "publish", "host")


class StepTimes(Protocol):
    """One tenant step's host-clock times (``benchmarks.e2e.StepRecord``): ``started`` and ``trained`` (when its train
    call was made) are ``time.perf_counter()`` readings, the rest durations from them."""

    tenant: str
    step: int
    started: float
    trained: float
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float


class GroupTimes(Protocol):
    """What :func:`gpu_busy` reads of a group (``benchmarks.e2e.ModeResult``)."""

    wall_s: float
    engine: EngineStats
    train_passes_s: float
    gpu_union_s: float | None


def gpu_busy(result: GroupTimes) -> dict[str, float | None]:
    """The GPU busy fraction's bounds over ``result.wall_s`` and their inputs (:data:`GPU_BUSY_METHOD`)."""
    stats = result.engine
    engine = stats.decode_gpu_seconds + stats.prefill_gpu_seconds + stats.prefill_copy_gpu_seconds
    train, wall = result.train_passes_s, max(result.wall_s, 1e-9)
    return {"engine_gpu_s": engine, "train_pass_s": train, "lower": min(1.0, max(engine, train) / wall),
            "upper": min(1.0, (engine + train) / wall),
            "union": None if result.gpu_union_s is None else result.gpu_union_s / wall}


def busy(row: dict) -> float:
    """A table row's GPU busy fraction: the union where measured, else the upper bound."""
    union = row["gpu_busy"]["union"]
    return row["gpu_busy"]["upper"] if union is None else union


def union_seconds(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` covered by at least one of ``intervals`` (``(start, end)`` pairs)."""
    covered, reached = 0.0, start
    for lo, hi in sorted(intervals):
        lo, hi = max(lo, reached), min(hi, end)
        if hi > lo:
            covered += hi - lo
            reached = hi
    return covered


def overlap(first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]], start: float,
            end: float) -> dict[str, float]:
    """``[start, end]`` split by what covers it: ``both`` (an interval of ``first`` and one of ``second``),
    ``first_only``, ``second_only`` and ``neither``; the four add up to ``end - start``."""
    a, b = union_seconds(first, start, end), union_seconds(second, start, end)
    either = union_seconds([*first, *second], start, end)
    both = a + b - either
    return {"both": both, "first_only": a - both, "second_only": b - both, "neither": (end - start) - either}


def tenant_phases(steps: Sequence[StepTimes], passes: Sequence[TrainPass]) -> dict[str, dict[str, float]]:
    """Per tenant of ``steps``: ``wall_s`` and its phases (:data:`TENANT_PHASES`, seconds, summing to ``wall_s``), its
    ``steps`` and their ``passes``. A tenant's k-th step trained in the k-th of ``passes`` holding it (the scheduler
    takes a tenant's one request at a time); raises ValueError when the counts differ or a pass lies outside its
    step's train call."""
    tenants: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(s.tenant for s in steps):
        own = sorted((s for s in steps if s.tenant == name), key=lambda s: s.step)
        held = [p for p in passes if name in p.tenants]
        if len(held) != len(own):
            raise ValueError(f"tenant {name}: {len(own)} steps but {len(held)} training passes")
        phases = dict.fromkeys(TENANT_PHASES, 0.0)
        for step, train in zip(own, held):
            called, returned = step.trained, step.trained + step.train_s
            if train.start < called - 1e-6 or train.end > returned + 1e-6:
                raise ValueError(f"tenant {name} step {step.step}: its pass [{train.start}, {train.end}] lies outside "
                                 f"its train call [{called}, {returned}]")
            phases["rollout"] += step.rollout_s
            phases["training"] += train.end - train.start
            phases["trainer_queue"] += step.train_s - (train.end - train.start)
            phases["publish"] += step.sync_s
        wall = own[-1].started + own[-1].step_s - own[0].started
        phases["host"] = wall - sum(phases.values())
        tenants[name] = {"wall_s": wall, **{f"{phase}_s": phases[phase] for phase in TENANT_PHASES},
                         "steps": len(own)}
    return tenants


def wall_account(window: tuple[float, float, float], stats: EngineStats, passes: Sequence[TrainPass],
                 steps: Sequence[StepTimes], turns: int) -> dict[str, Any]:
    """The wall account of a group (module docstring) whose ``window`` is (its start, its services built, its engine
    thread shut down: its end) on the host clock, from the engine's counters over its life ``stats``, the
    scheduler's ``passes``, the tenants' ``steps`` and ``turns``, the requests the tenants made (each one's first
    token is its prefill's)."""
    began, built, stopped = window
    life = stopped - built
    decode_tokens = stats.generated_tokens - turns - stats.preemptions  # a preempted request is prefilled again
    busy_other = stats.busy_seconds - stats.decode_seconds - stats.prefill_seconds
    counted = stats.busy_seconds + stats.paused_seconds + stats.idle_seconds
    pass_s = sum(p.end - p.start for p in passes)
    paused = [p for p in passes if p.paused]
    rows = [p.rows_decoding for p in passes if p.rows_decoding is not None]
    run_start = min(s.started for s in steps)
    run_end = max(s.started + s.step_s for s in steps)
    rollouts = [(s.started, s.started + s.rollout_s) for s in steps]
    shares = overlap(rollouts, [(p.start, p.end) for p in passes], run_start, run_end)
    tenants = tenant_phases(steps, passes)
    return {
        "wall_s": stopped - began, "setup_s": built - began, "engine_life_s": life,
        "engine": {
            "decode_s": stats.decode_seconds, "decode_steps": stats.decode_steps,
            "decode_ms_per_step": 1e3 * stats.decode_seconds / max(stats.decode_steps, 1),
            "rows_per_step": decode_tokens / max(stats.decode_steps, 1),
            "decode_wait_s": stats.decode_wait_seconds, "decode_gpu_s": stats.decode_gpu_seconds,
            "prefill_s": stats.prefill_seconds, "prefill_rounds": stats.prefill_rounds, "other_busy_s": busy_other,
            "paused_s": stats.paused_seconds, "idle_s": stats.idle_seconds, "unaccounted_s": life - counted,
        },
        "trainer": {
            "passes": len(passes), "pass_s": pass_s, "paused_passes": len(paused),
            "paused_pass_s": sum(p.end - p.start for p in paused),
            "rows_decoding_at_pass_start": statistics.mean(rows) if rows else None, "idle_s": life - pass_s,
        },
        "run_window": {"window_s": run_end - run_start, "rollout_and_training_s": shares["both"],
                       "rollout_only_s": shares["first_only"], "training_only_s": shares["second_only"],
                       "neither_s": shares["neither"]},
        "tenants": tenants,
        "tenant_mean": {key: statistics.mean(t[key] for t in tenants.values())
                        for key in ("wall_s", *(f"{phase}_s" for phase in TENANT_PHASES))},
    }


def describe(label: str, account: dict[str, Any]) -> str:
    """The account as the few lines the benchmark prints for group ``label``."""
    engine, trainer, run, mean = account["engine"], account["trainer"], account["run_window"], account["tenant_mean"]
    rows = trainer["rows_decoding_at_pass_start"]
    return "\n".join([
        f"{label} wall account: {account['wall_s']:.1f} s = setup {account['setup_s']:.1f} + engine life "
        f"{account['engine_life_s']:.1f}",
        f"  engine life: decode {engine['decode_s']:.1f} s ({engine['decode_steps']} steps of "
        f"{engine['decode_ms_per_step']:.1f} ms, {engine['rows_per_step']:.0f} rows per step), prefill "
        f"{engine['prefill_s']:.1f} s ({engine['prefill_rounds']} rounds), other busy {engine['other_busy_s']:.1f}, "
        f"paused for training {engine['paused_s']:.1f}, idle {engine['idle_s']:.1f}, unaccounted "
        f"{engine['unaccounted_s']:.2f}",
        f"  trainer: {trainer['passes']} passes {trainer['pass_s']:.1f} s ({trainer['paused_passes']} paused sampling, "
        f"{trainer['paused_pass_s']:.1f} s"
        + ("" if rows is None else f"; {rows:.0f} rows decoding at a pass's start on average")
        + f"), idle {trainer['idle_s']:.1f} s",
        f"  run window {run['window_s']:.1f} s: rollouts and training {run['rollout_and_training_s']:.1f}, rollouts only "
        f"{run['rollout_only_s']:.1f}, training only {run['training_only_s']:.1f}, neither {run['neither_s']:.1f}",
        f"  per tenant (mean of {len(account['tenants'])}): wall {mean['wall_s']:.1f} s = rollout {mean['rollout_s']:.1f} "
        f"+ trainer queue {mean['trainer_queue_s']:.1f} + training {mean['training_s']:.1f} + publish "
        f"{mean['publish_s']:.2f} + host {mean['host_s']:.2f}",
    ])
