"""Experiment throughput on one GPU: N experiments run serially (each with its own cold start) vs concurrently
on one warm model (swap and packed training), side by side in one run.

Model: a Qwen3-shaped checkpoint with random bf16 weights, written to disk once and loaded from it at every
cold start (load weights, build the engine, capture its CUDA graphs). Workload per tenant step, shaped like
GSM8K-agentic RL: ``prompts`` prompts x ``samples`` samples; each episode has ``turns`` turns, with an
``observation``-token tool result between turns; the first prompt is ``prompt`` tokens. Each turn samples
exactly its drawn length (no stop tokens): ``--lengths fixed:N`` (the default, N = ``--response``, 100) or a
long-tailed ``--lengths lognormal:median=M,sigma=S,cap=C`` / ``longtail`` / ``hard`` (``benchmarks.workloads``),
drawn per (tenant seed, step, episode, turn) so that serial and concurrent runs sample the same lengths; the
run config's ``generator.max_input_length`` / ``max_generate_length`` cover the longest episode the distribution
allows, so no turn is cut short (the line above the table counts turns that came back short: none expected).
Observation tokens come from the same counters; prompts and rewards from a per-tenant generator in program
order. Training is the production GRPO step (SkyRL's advantage estimator and policy loss) on random rewards;
after it the tenant's adapter is published into the sampler in place. ``steps`` steps per experiment. The
services are the production ones (``skyrl_clora.backends.embedded.services.build_services``); only the episodes are synthetic
(a random model writes no parsable tool calls).

Serial mode runs the experiments one after another, each paying its cold start; serial time for N is the
sum of the first N experiments. Concurrent mode runs N experiments at once on one cold start. With ``--serial K``
only the first K serial experiments run (N=16 or 32 would take a serial hour), and an N above K compares
experiments per hour with the K serial experiments' rate (the same workload, other seeds' lengths).

One table, per mode and N: wall time, experiments per hour, experiment throughput ratio vs serial, mean per-tenant step time and
mean rollout time per tenant step, each with its ratio to the same mode's N=1 (serial's when that mode did not
run N=1), train / sync split, decode tokens/s, the GPU busy fraction of the wall time (:func:`gpu_busy`), training
MFU (the model FLOP of the batches trained, :func:`benchmarks.common.train_pass_flop`, over the passes' time and
``--peak-tflops``), peak GPU memory, the most rows running at once, preemptions, the prompt tokens prefilled over the distinct ones
(recompute: 1.00 when no prompt position is computed twice, :meth:`Workload.distinct_prompt_tokens`) and the engine's
adapter slots (hit
rate: admissions that found their adapter in a device slot; loads: adapters written into one, see
``--override sampler.adapter_slots=K``) and the sampling requests' queue waits, submission to admission (wait p50:
the median tenant's p50; wait p99: the worst tenant's p99; fairness: each tenant's summed wait and mean step time,
worst over median; ``--override sampler.admission=fair`` orders admission by
tenants' service); above it, the per-turn lengths drawn (mean, p50, p90, max). After each group,
its wall account (:func:`benchmarks.wall.wall_account`: the engine thread's, the trainer's and each tenant's time).
Full numbers go to ``--out`` as JSON (``rows``, each with its ``wall_account``; ``lengths``: the spec and the drawn
lengths' summary; ``gpu_busy_method``).

Usage (GPU): python -m benchmarks.e2e --shape qwen3-1.7b --tokenizer <model dir with a chat template> --lengths longtail --out $OUT/e2e.json
On the CPU (``--device cpu --shape tiny``, small sizes) it runs as a smoke run: its figures say only that the script
runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from benchmarks.common import H200_BF16_TFLOPS, QWEN3_VOCAB, train_pass_flop, write_random_model
from benchmarks.wall import GPU_BUSY_METHOD, busy, describe, gpu_busy, union_seconds, wall_account
from benchmarks.workloads import Lengths, counter_rng, distinct_prompt_tokens, length_summary, parse_lengths

from skyrl_clora.backends.embedded.services import Services, build_services, release_device_memory
from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.config.compose import compose_config
from skyrl_clora.sampler.engine_stats import EngineStats
from skyrl_clora.sampler.requests import SamplingParams, derive_seed
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.scheduler import TrainPass, TrainScheduler
from skyrl_clora.trainer.trainer import TrainBatch

LORA_RANK = 16  # every tenant's adapter rank (alpha 2 x rank)


@dataclass(frozen=True)
class Workload:
    """One tenant step: ``prompts`` x ``samples`` episodes of ``turns`` turns, each turn sampling a length drawn
    from ``lengths`` (at most ``lengths.cap``), ``observation`` tokens between turns, ``prompt``-token prompts."""

    prompt: int = 256
    lengths: Lengths = Lengths("fixed", 100)
    observation: int = 32
    turns: int = 3
    prompts: int = 8
    samples: int = 8
    steps: int = 3
    # A tenant step at fixed:100 (8 prompts once + 64 responses of 364 tokens, ~25k positions with shared
    # prompts) in one micro-batch: half the trainer's launches of 32-row micro-batches (RESULTS.md, Training:
    # packed vs swap). Longer draws split into more micro-batches (the longest row, 3392 tokens at ``hard``, fits).
    max_tokens_per_microbatch: int = 32768
    overrides: tuple[str, ...] = ()  # further config overrides (--override), e.g. clora.shared_prompts=true

    def distinct_prompt_tokens(self, tenants: int) -> int:
        """:func:`benchmarks.workloads.distinct_prompt_tokens` over ``tenants`` experiments."""
        return distinct_prompt_tokens(tenants * self.steps * self.prompts, self.samples, self.prompt, self.turns,
                                      self.observation)

    @property
    def max_input(self) -> int:
        """The longest last-turn context: the prompt and every earlier turn at the cap with its observation."""
        return self.prompt + (self.turns - 1) * (self.lengths.cap + self.observation)


@dataclass
class StepRecord:
    tenant: str
    step: int
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    generated_tokens: int
    short_turns: int = 0  # turns whose completion came back shorter than the drawn length (none expected)
    train_flop: float = 0.0  # the model FLOP of training the step's batch (train_pass_flop)
    started: float = 0.0  # time.perf_counter() at the step's start
    trained: float = 0.0  # time.perf_counter() when its train call was made


@dataclass
class ModeResult:
    mode: str
    tenants: int
    wall_s: float
    cold_start_s: list[float]
    steps: list[StepRecord] = field(default_factory=list)
    engine: EngineStats = field(default_factory=EngineStats)  # the engine's counters over the run
    peak_memory_gib: float = 0.0
    peak_reserved_gib: float = 0.0  # the caching allocator's peak reservation
    alloc_retries: int = 0  # allocations that had to free cached blocks and retry (each synchronises the device)
    train_passes_s: float = 0.0  # the trainer's passes (TrainScheduler.pass_seconds)
    gpu_union_s: float | None = None  # the union of the engine's GPU intervals and the passes (CUDA; gpu_busy)
    train_overlaps_sampling: bool = False  # the engine kept sampling during training passes (no pause)
    turn_lengths: list[int] = field(default_factory=list)  # every turn's drawn length, in completion order
    passes: list[TrainPass] = field(default_factory=list)  # the scheduler's passes
    account: dict | None = None  # the wall account (benchmarks.wall.wall_account); None for combined serial groups
    queue_waits: dict[str, dict[str, float]] = field(default_factory=dict)  # per tenant (EngineThread.queue_waits)
    host_store_gib: float = 0.0  # the trainer's AdapterStore entries in host memory (AdapterStore.host_bytes)
    peak_rss_gib: float = 0.0  # the benchmark process's peak resident memory so far (every group before this one too)
    distinct_prompt_tokens: int = 0  # Workload.distinct_prompt_tokens of its experiments


def run_config(model_dir: Path, workload: Workload, train_mode: str, tenants: int, device: str):
    overrides = [
        f"trainer.policy.model.path={model_dir}", "model.dtype=bfloat16", f"clora.device={device}", f"clora.train_mode={train_mode}",
        f"+tenants={tenants}", f"trainer.max_training_steps={workload.steps}", "clora.progress=false",
        f"trainer.max_prompt_length={workload.max_input}", f"generator.sampling_params.max_generate_length={workload.lengths.cap}",
        f"generator.n_samples_per_prompt={workload.samples}", f"trainer.train_batch_size={workload.prompts}",
        "sampler.prefill_block=128", "sampler.max_prefills_per_step=64",
        f"trainer.max_tokens_per_microbatch={workload.max_tokens_per_microbatch}", f"trainer.policy.model.lora.rank={LORA_RANK}", f"sampler.max_lora_rank={LORA_RANK}",
        *workload.overrides,
    ]
    return plan_steps(build_run_config(compose_config(overrides)), workload.steps * workload.prompts)


async def episode(services: Services, tenant: str, seed: int, step: int, index: int, prompt: list[int],
                  workload: Workload, drawn: list[int]) -> tuple[list[int], list[int], int]:
    """Episode ``index`` of ``step`` of the tenant seeded ``seed``: each turn asks for its drawn length (appended
    to ``drawn``; no stop tokens, so the engine samples exactly that many), observations come from the same
    counters, so the episode is the same whatever runs beside it. Returns the response ids (sampled turns and
    observations), their loss mask and the turns that came back short."""
    context, response, mask, short = list(prompt), [], [], 0
    for turn in range(workload.turns):
        length = workload.lengths.draw(seed, step, index, turn)
        drawn.append(length)
        params = SamplingParams(max_tokens=length, temperature=1.0,
                                seed=derive_seed(0, f"{tenant}/{seed}-{step}-{index}", len(context)))
        completion = await asyncio.wrap_future(services.engine.submit(context, tenant, params))
        short += len(completion.token_ids) < length
        response += completion.token_ids
        mask += [1] * len(completion.token_ids)
        context += completion.token_ids
        if turn + 1 < workload.turns:
            observation = counter_rng(seed, step, index, turn, 1).integers(0, 1000, workload.observation).tolist()
            response += observation
            mask += [0] * len(observation)
            context += observation
    return response, mask, short


async def experiment(services: Services, scheduler: TrainScheduler, tenant: str, seed: int, workload: Workload,
                     result: ModeResult) -> None:
    """``workload.steps`` steps of one tenant: rollout, GRPO training, publish; appends to ``result``."""
    generator = torch.Generator().manual_seed(seed)  # prompts and rewards, drawn in program order
    for step in range(1, workload.steps + 1):
        started = time.perf_counter()
        prompts = [torch.randint(0, 1000, (workload.prompt,), generator=generator).tolist() for _ in range(workload.prompts)]
        rows = [(index, prompt) for index, prompt in enumerate(prompts) for _ in range(workload.samples)]
        results = await asyncio.gather(*(episode(services, tenant, seed, step, index, prompt, workload,
                                                 result.turn_lengths) for index, (_, prompt) in enumerate(rows)))
        rollout_s = time.perf_counter() - started
        batch = TrainBatch(
            prompt_ids=[prompt for _, prompt in rows], response_ids=[r for r, _, _ in results],
            loss_masks=[m for _, m, _ in results], rewards=torch.rand(len(rows), generator=generator).round().tolist(),
            group_ids=[f"{tenant}-{step}-{index}" for index, _ in rows], rollout_logprobs=None,
        )
        flop = train_pass_flop(services.trainer.model.config, 16, [len(p) for p in batch.prompt_ids],
                               [len(r) for r in batch.response_ids], batch.group_ids, services.trainer.shared_prefix)
        trained = time.perf_counter()
        weights, _ = await scheduler.train(tenant, batch)
        train_s = time.perf_counter() - trained
        _, sync_s = await services.sync.publish(tenant, weights)
        result.steps.append(StepRecord(tenant, step, rollout_s, train_s, sync_s, time.perf_counter() - started,
                                       sum(sum(m) for _, m, _ in results), sum(s for _, _, s in results), flop,
                                       started, trained))


def register(services: Services, run, tenant: str, seed: int) -> None:
    weights = init_adapter(services.trainer.layers, LORA_RANK, 2.0 * LORA_RANK, torch.Generator().manual_seed(seed))
    services.store.register(tenant, weights, LRSchedule(1e-4, 0, run.steps, "constant"), seed=seed)
    services.sync.register(tenant, services.store.tenants[tenant].weights)


def run_group(model_dir: Path, workload: Workload, train_mode: str, names: list[str], seeds: list[int],
              device: str) -> ModeResult:
    """One cold start, then ``names`` experiments concurrently; returns the measured result."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    started = time.perf_counter()
    run = run_config(model_dir, workload, train_mode, len(names), device)
    rows_per_tenant = workload.prompts * workload.samples
    services = build_services(run, str(model_dir), len(names), rows_per_tenant)
    built = time.perf_counter()
    result = ModeResult(train_mode, len(names), 0.0, [services.cold_start_seconds],
                        distinct_prompt_tokens=workload.distinct_prompt_tokens(len(names)))
    timeline = services.engine.record_gpu_intervals() if cuda else None
    try:
        for name, seed in zip(names, seeds):
            register(services, run, name, seed)
        result.host_store_gib = len(names) * services.store.host_bytes(LORA_RANK) / 2**30

        async def main() -> None:
            scheduler = services.train_scheduler(run)
            result.train_overlaps_sampling = scheduler.sampler is None
            await asyncio.gather(*(experiment(services, scheduler, name, seed, workload, result)
                                   for name, seed in zip(names, seeds)))
            result.train_passes_s = scheduler.pass_seconds
            result.passes = list(scheduler.passes)

        asyncio.run(main())
    finally:
        services.shutdown()
    stopped = time.perf_counter()
    result.wall_s = stopped - started
    if timeline is not None:
        result.gpu_union_s = union_seconds([*timeline.intervals, *((p.start, p.end) for p in result.passes)], started,
                                           stopped)
    result.engine = replace(services.engine.stats)
    result.queue_waits = services.engine.queue_waits()
    result.peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    result.account = wall_account((started, built, stopped), result.engine, result.passes, result.steps,
                                  len(result.turn_lengths))
    if cuda:
        result.peak_memory_gib = torch.cuda.max_memory_allocated() / 2**30
        result.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
        result.alloc_retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before
    return result


def run_and_release(model_dir: Path, workload: Workload, train_mode: str, names: list[str], seeds: list[int],
                    device: str, label: str | None = None) -> ModeResult:
    """:func:`run_group` (its result's mode named ``label``, default the train mode), then frees the GPU memory
    its services held (the next cold start starts empty)."""
    result = run_group(model_dir, workload, train_mode, names, seeds, device)
    result.mode = label or train_mode
    row = summarize(result)
    stats, steps = result.engine, max(result.engine.decode_steps, 1)
    per_step = {name: 1e3 * getattr(stats, name) / steps for name in (
        "decode_seconds", "decode_wait_seconds", "decode_input_seconds", "decode_launch_seconds", "decode_gpu_seconds")}
    print(f"{result.mode} x{len(names)}: wall {result.wall_s:.1f} s, cold start {result.cold_start_s[0]:.1f} s, per step "
          f"{row['step_s']:.2f} s (rollout {row['rollout_s']:.2f}, train {row['train_s']:.2f}, sync {row['sync_s']:.2f}), "
          f"engine decode {stats.decode_seconds:.1f} s ({stats.decode_steps} steps of {per_step['decode_seconds']:.1f} ms: "
          f"{per_step['decode_wait_seconds']:.1f} ms waiting for the GPU's tokens, "
          f"{per_step['decode_gpu_seconds']:.1f} ms of GPU time in the forward pass, "
          f"{per_step['decode_input_seconds']:.2f} ms staging inputs, {per_step['decode_launch_seconds']:.2f} ms launching; "
          f"{stats.generated_tokens / steps:.0f} tokens sampled per step; retiring requests {stats.retire_seconds:.2f} s) / "
          f"prefill {stats.prefill_seconds:.1f} s ({stats.prefill_rounds} rounds of "
          f"{1e3 * stats.prefill_seconds / max(stats.prefill_rounds, 1):.0f} ms, "
          f"{1e3 * stats.prefill_copy_gpu_seconds / max(stats.prefill_rounds, 1):.1f} ms of GPU time copying cached K/V "
          f"into rows and {1e3 * stats.prefill_gpu_seconds / max(stats.prefill_rounds, 1):.1f} ms in the forward pass, "
          f"{stats.prefill_tokens} prompt tokens computed ({row['prompt_recompute']:.2f}x the "
          f"{result.distinct_prompt_tokens} distinct), {stats.cached_prompt_tokens} from the prefix cache; "
          f"{stats.shared_prefix_positions / steps:.0f} key positions per decode step read from "
          f"a shared copy); engine thread busy {stats.busy_seconds:.1f} s, paused {stats.paused_seconds:.1f} s, idle "
          f"{stats.idle_seconds:.1f} s ({stats.idle_waits} waits of 1 ms or more, the longest "
          f"{stats.longest_idle_seconds:.2f} s); training passes {result.train_passes_s:.1f} s; allocator: peak "
          f"{result.peak_memory_gib:.1f} GiB allocated, {result.peak_reserved_gib:.1f} GiB reserved, "
          f"{result.alloc_retries} retries; rows running at once: at most {stats.peak_running_rows}, "
          f"{stats.preemptions} preempted; adapter slots: {stats.adapter_hits} admissions found their adapter in its "
          f"slot, {stats.adapter_loads} loaded it ({stats.adapter_evictions} evicting another), hit rate "
          f"{stats.adapter_hit_rate:.1%}; queue waits (submission to admission): p50 {row['queue_wait_p50_s']:.3f} s "
          f"(the median tenant's), p99 {row['queue_wait_p99_s']:.3f} s (the worst tenant's); a tenant's summed wait: "
          f"median {row['tenant_wait_total_median_s']:.1f} s, worst {row['tenant_wait_total_max_s']:.1f} s; a tenant's "
          f"mean step: median {row['tenant_step_median_s']:.2f} s, worst {row['tenant_step_max_s']:.2f} s; host memory: the "
          f"tenants' trainer state {result.host_store_gib:.2f} GiB, process peak RSS {result.peak_rss_gib:.1f} GiB",
          flush=True)
    print(describe(f"{result.mode} x{len(names)}", result.account), flush=True)
    release_device_memory()
    return result


def summarize(result: ModeResult) -> dict:
    """One table row of ``result``: per-tenant-step means (seconds), throughput, GPU busy, drawn lengths, and the
    sampling requests' queue waits: the median over tenants of each tenant's p50, the largest tenant p99, and each
    tenant's (``queue_waits``); fairness: the median and largest over tenants of each tenant's summed queue wait
    (``tenant_wait_total_*``) and of each tenant's mean step time (``tenant_step_*``)."""
    steps = result.steps
    waits = result.queue_waits.values()
    totals = [w["total_s"] for w in waits] or [0.0]
    tenant_steps = [statistics.mean(s.step_s for s in steps if s.tenant == tenant) for tenant in {s.tenant for s in steps}]
    return {
        "mode": result.mode, "tenants": result.tenants, "wall_s": result.wall_s, "cold_start_s": result.cold_start_s,
        "step_s": statistics.mean(s.step_s for s in steps), "rollout_s": statistics.mean(s.rollout_s for s in steps),
        "train_s": statistics.mean(s.train_s for s in steps), "sync_s": statistics.mean(s.sync_s for s in steps),
        "decode_tokens_per_s": result.engine.generated_tokens / max(result.engine.decode_seconds, 1e-9),
        "peak_memory_gib": result.peak_memory_gib, "gpu_busy": gpu_busy(result),
        "train_tflops_per_s": sum(s.train_flop for s in steps) / 1e12 / max(result.train_passes_s, 1e-9),
        "train_overlaps_sampling": result.train_overlaps_sampling,
        "turn_lengths": length_summary(result.turn_lengths), "short_turns": sum(s.short_turns for s in steps),
        "peak_running_rows": result.engine.peak_running_rows, "preemptions": result.engine.preemptions,
        "adapter_loads": result.engine.adapter_loads, "adapter_evictions": result.engine.adapter_evictions,
        "adapter_hit_rate": result.engine.adapter_hit_rate, "wall_account": result.account,
        "queue_wait_p50_s": statistics.median(w["p50_s"] for w in waits) if waits else 0.0,
        "queue_wait_p99_s": max((w["p99_s"] for w in waits), default=0.0), "queue_waits": result.queue_waits,
        "tenant_wait_total_median_s": statistics.median(totals), "tenant_wait_total_max_s": max(totals),
        "tenant_step_median_s": statistics.median(tenant_steps), "tenant_step_max_s": max(tenant_steps),
        "host_store_gib": result.host_store_gib, "peak_rss_gib": result.peak_rss_gib,
        "prompt_tokens_computed": result.engine.prefill_tokens, "distinct_prompt_tokens": result.distinct_prompt_tokens,
        "prompt_recompute": result.engine.prefill_tokens / max(result.distinct_prompt_tokens, 1),
    }


def combine(results: list[ModeResult], mode: str) -> ModeResult:
    """``results`` (one experiment each, run one after another) as one group: walls, counters and steps add up."""
    added = ("generated_tokens", "decode_seconds", "decode_gpu_seconds", "prefill_gpu_seconds",
             "prefill_copy_gpu_seconds", "preemptions", "adapter_hits", "adapter_loads", "adapter_evictions",
             "prefill_tokens", "cached_prompt_tokens")
    engine = EngineStats(**{name: sum(getattr(r.engine, name) for r in results) for name in added},
                         peak_running_rows=max(r.engine.peak_running_rows for r in results))
    return ModeResult(mode, len(results), sum(r.wall_s for r in results), [c for r in results for c in r.cold_start_s],
                      [s for r in results for s in r.steps], engine, max(r.peak_memory_gib for r in results),
                      train_passes_s=sum(r.train_passes_s for r in results),
                      gpu_union_s=None if any(r.gpu_union_s is None for r in results)
                      else sum(r.gpu_union_s for r in results),
                      train_overlaps_sampling=results[0].train_overlaps_sampling,
                      turn_lengths=[length for r in results for length in r.turn_lengths],
                      queue_waits={tenant: w for r in results for tenant, w in r.queue_waits.items()},
                      host_store_gib=max(r.host_store_gib for r in results),
                      peak_rss_gib=max(r.peak_rss_gib for r in results),
                      distinct_prompt_tokens=sum(r.distinct_prompt_tokens for r in results))


def table_rows(serial: list[ModeResult], concurrent: dict[tuple[str, int], ModeResult], tenants: list[int],
               labels: list[str]) -> list[dict]:
    """The table's rows: per N of ``tenants``, the serial group of the first N ``serial`` experiments (when that many
    ran) and each concurrent mode of ``labels`` at N, with its throughput vs serial (the same N experiments' serial
    wall over its wall; for N above the serial experiments run, its experiments per hour over their rate, marked in
    ``serial_basis``), experiments per hour and step / rollout times vs the same mode's N=1 (serial's when that mode
    did not run N=1)."""
    rows = []
    serial_rate = len(serial) / sum(r.wall_s for r in serial)  # experiments per second, one after another
    for n in tenants:
        if n <= len(serial):  # the first n serial experiments: the same experiments as the concurrent n
            serial_wall = sum(r.wall_s for r in serial[:n])
            rows.append({**summarize(combine(serial[:n], "serial")), "throughput_vs_serial": 1.0,
                         "serial_basis": f"the same {n}"})
        for label in labels:
            result = concurrent[(label, n)]
            ratio = serial_wall / result.wall_s if n <= len(serial) else n / result.wall_s / serial_rate
            rows.append({**summarize(result), "throughput_vs_serial": ratio,
                         "serial_basis": f"the same {n}" if n <= len(serial) else f"the rate of {len(serial)}"})
    for row in rows:
        row["experiments_per_hour"] = row["tenants"] / row["wall_s"] * 3600
    # Ratios to the same mode at N=1, or to serial N=1 (one swap experiment) when that mode did not run N=1.
    one = {row["mode"]: row for row in rows if row["tenants"] == 1}
    serial_one = summarize(combine(serial[:1], "serial"))
    for row in rows:
        base = one.get(row["mode"], serial_one)
        row.update(vs_n1_base=f"{base['mode']} N=1", step_vs_n1=row["step_s"] / base["step_s"],
                   rollout_vs_n1=row["rollout_s"] / base["rollout_s"])
    return rows


def profile_experiment(model_dir: Path, workload: Workload, mode: str, tenants: int, device: str, out: Path) -> None:
    """``tenants`` concurrent experiments of ``workload`` in train ``mode`` (after the warm-up) under
    ``torch.profiler``: writes the top GPU kernels and the top CPU entries to ``out`` with suffixes
    ``.kernels.txt`` / ``.cpu.txt``. The engine and the trainer run on their own threads, where the profiler
    records CUDA runtime calls and kernels but not operators or named ranges (it records those on the
    thread that started it only)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run_and_release(model_dir, workload, mode, [f"profiled-{i}" for i in range(tenants)],
                        list(range(1, tenants + 1)), device)
    averages = prof.key_averages()
    out.parent.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        out.with_suffix(".kernels.txt").write_text(averages.table(sort_by="self_cuda_time_total", row_limit=50))
    out.with_suffix(".cpu.txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=50))


def write_partial(path: Path, serial: list[ModeResult], concurrent: dict[tuple[str, int], ModeResult]) -> None:
    """Writes every group measured so far to ``path`` (replaced by the final table's JSON at the end)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    groups = [{**asdict(r), "turn_lengths": length_summary(r.turn_lengths)} for r in [*serial, *concurrent.values()]]
    path.write_text(json.dumps({"partial": True, "groups": groups}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=next(line for line in __doc__.splitlines() if line.startswith("Usage")))
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["swap", "packed"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", metavar="SPEC",
                        help="each turn's sampled length: fixed:N (the default, fixed:100), "
                             "lognormal:median=M,sigma=S,cap=C (round(M*exp(S*z)), z ~ N(0,1), clipped to [1, C]), "
                             "or a preset: longtail (= lognormal:median=128,sigma=1.0,cap=512), hard (= "
                             "lognormal:median=300,sigma=0.9,cap=1024); drawn per (tenant seed, step, episode, turn), "
                             "the same in serial and concurrent runs")
    parser.add_argument("--response", type=int, metavar="N", help="the same as --lengths fixed:N")
    parser.add_argument("--prompts", type=int, default=Workload.prompts, help="prompts per tenant step")
    parser.add_argument("--samples", type=int, default=Workload.samples, help="episodes per prompt")
    parser.add_argument("--prompt", type=int, default=Workload.prompt, help="tokens per prompt")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the table: profile 1-step experiments after the warm-up (the largest --tenants "
                             "concurrently, the first of --modes) and write the GPU-kernel and CPU tables beside --out")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (serial and concurrent alike), e.g. clora.shared_prompts=true")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="also run every concurrent mode with these overrides, as mode+NAME (serial runs without), "
                             "e.g. carve32:clora.sm_carveout=32")
    parser.add_argument("--serial", type=int, metavar="K",
                        help="run only the first K serial experiments (default: the largest --tenants); a larger N's "
                             "'x serial' is then its experiments per hour over the K serial experiments' rate")
    parser.add_argument("--warmup-tenants", type=int, metavar="K",
                        help="warm up at K tenants only (and 1), not at every --tenants: for N too large to run twice "
                             "in a call; shapes only a larger N reaches then compile inside its timed run")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="training MFU's denominator")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if min(args.prompts, args.samples, args.prompt) < 1:
        parser.error("--prompts, --samples and --prompt must be at least 1")
    if args.lengths is not None and args.response is not None:
        parser.error("--response N is --lengths fixed:N; give one of them")
    try:
        lengths = parse_lengths(args.lengths or f"fixed:{args.response or 100}")
    except ValueError as error:
        parser.error(str(error))
    variants = {"": ()}
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        if not name or "=" not in overrides:
            parser.error(f"--variant {spec!r}: use NAME:KEY=VALUE[,KEY=VALUE]")
        variants[f"+{name}"] = tuple(overrides.split(","))
    labels = [mode + suffix for suffix in variants for mode in args.modes]
    serial_count = max(args.tenants) if args.serial is None else args.serial
    if not 1 <= serial_count <= max(args.tenants):
        parser.error(f"--serial {args.serial}: give 1 to the largest --tenants ({max(args.tenants)})")
    if args.warmup_tenants is not None and not 1 <= args.warmup_tenants <= max(args.tenants):
        parser.error(f"--warmup-tenants {args.warmup_tenants}: give 1 to the largest --tenants ({max(args.tenants)})")
    warmups = set(args.tenants) if args.warmup_tenants is None else {args.warmup_tenants}
    workload = Workload(prompt=args.prompt, lengths=lengths, prompts=args.prompts, samples=args.samples,
                        steps=args.steps, overrides=tuple(args.override))
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder) / args.shape
        write_random_model(args.shape, args.tokenizer, model_dir, args.device, vocab_size=QWEN3_VOCAB)
        most = max(args.tenants)
        names, seeds = [f"tenant-{i}" for i in range(most)], list(range(1, most + 1))
        # Untimed: compiles the Triton kernels once per process (cached for every later cold start), at every
        # N in every mode, so that no timed group pays for the shapes only it reaches (without it a group first
        # at its N paid compiles, N=2 and the first serial experiment paid prefill shapes only their N reaches,
        # and without N=1 among --tenants the serial experiments paid theirs).
        warm_names = [f"warm-up-{i}" for i in range(most)]
        for n in sorted(warmups | {1}, reverse=True):
            for mode in args.modes:
                run_and_release(model_dir, replace(workload, steps=1), mode, warm_names[:n], [0] * n, args.device,
                                f"warm-up {mode}")
        if args.profile:
            profile_experiment(model_dir, replace(workload, steps=1), args.modes[0], most, args.device, args.out)
            return
        serial: list[ModeResult] = []
        for name, seed in zip(names[:serial_count], seeds[:serial_count]):
            serial.append(run_and_release(model_dir, workload, "swap", [name], [seed], args.device))
            write_partial(args.out, serial, {})
        # Largest N first: the headline ratio survives a run cut short by a time limit.
        concurrent: dict[tuple[str, int], ModeResult] = {}
        for n in sorted(args.tenants, reverse=True):
            for suffix, overrides in variants.items():
                for mode in args.modes:
                    variant = replace(workload, overrides=workload.overrides + overrides)
                    result = run_and_release(model_dir, variant, mode, names[:n], seeds[:n], args.device, mode + suffix)
                    concurrent[(result.mode, n)] = result
                    write_partial(args.out, serial, concurrent)
    rows = table_rows(serial, concurrent, args.tenants, labels)
    drawn = length_summary(length for r in serial for length in r.turn_lengths)  # every tenant's draws, once
    short = sum(s.short_turns for r in [*serial, *concurrent.values()] for s in r.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"shape": args.shape, "workload": asdict(workload), "lengths": {"spec": lengths.spec, "drawn": drawn},
              "gpu_busy_method": GPU_BUSY_METHOD, "peak_tflops": args.peak_tflops, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.shape}: {workload}")
    print(f"lengths {lengths.spec}: {drawn['count']} turns drawn over {len(serial)} serial experiments, mean "
          f"{drawn['mean']:.0f}, p50 {drawn['p50']:.0f}, p90 {drawn['p90']:.0f}, max {drawn['max']:.0f}; turns cut "
          f"short in all groups: {short}; GPU busy: the union where measured (CUDA), else the upper bound (--out: the "
          f"bounds too)"
          + ("" if all(n <= len(serial) for n in args.tenants) else
             f"; *: experiments per hour over the rate of the {len(serial)} serial experiments"))
    print(f"{'mode':14} {'N':>3} {'wall s':>7} {'exp/h':>6} {'x serial':>8} {'step s':>7} {'vs N=1':>6} {'rollout':>7} {'vs N=1':>6} "
          f"{'train':>6} {'sync':>5} {'decode tok/s':>12} {'GPU busy':>8} {'MFU':>6} {'peak GiB':>8} {'rows':>5} {'preempt':>7} {'recompute':>9} "
          f"{'slot hit':>8} {'loads':>6} {'wait p50':>8} {'wait p99':>8} {'host GiB':>8}")
    for row in rows:
        print(f"{row['mode']:14} {row['tenants']:3d} {row['wall_s']:7.1f} {row['experiments_per_hour']:6.0f} "
              f"{row['throughput_vs_serial']:7.2f}{'' if row['serial_basis'].startswith('the same') else '*'} "
              f"{row['step_s']:7.2f} {row['step_vs_n1']:6.2f} {row['rollout_s']:7.2f} {row['rollout_vs_n1']:6.2f} "
              f"{row['train_s']:6.2f} {row['sync_s']:5.2f} {row['decode_tokens_per_s']:12.0f} "
              f"{busy(row):8.2f} {row['train_tflops_per_s'] / args.peak_tflops:6.1%} {row['peak_memory_gib']:8.1f} "
              f"{row['peak_running_rows']:5d} "
              f"{row['preemptions']:7d} {row['prompt_recompute']:9.2f} {row['adapter_hit_rate']:8.1%} {row['adapter_loads']:6d} "
              f"{row['queue_wait_p50_s']:8.3f} {row['queue_wait_p99_s']:8.3f} {row['host_store_gib']:8.2f}")


if __name__ == "__main__":
    main()
