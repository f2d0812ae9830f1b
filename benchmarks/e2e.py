"""Experiment throughput on one GPU: N experiments run serially (each with its own cold start) vs concurrently
on one warm model (swap and packed training), side by side in one run.

Model: a Qwen3-shaped checkpoint with random bf16 weights, written to disk once and loaded from it at every
cold start (load weights, build the engine, capture its CUDA graphs). Workload per tenant step, shaped like
GSM8K-agentic RL: ``prompts`` prompts x ``samples`` samples; each episode has ``turns`` turns of exactly
``response`` sampled tokens, with a ``observation``-token tool result between turns; the first prompt is
``prompt`` tokens. Training is the production GRPO step (SkyRL's advantage estimator and policy loss) on
random rewards; after it the tenant's adapter is published into the sampler in place. ``steps`` steps per
experiment. The services are the production ones (``skyrl_clora.services.build_services``); only the
episodes are synthetic (a random model writes no parsable tool calls).

Serial mode runs the experiments one after another, each paying its cold start; serial time for N is the
sum of the first N experiments. Concurrent mode runs N experiments at once on one cold start.

One table: experiment throughput ratio vs serial, mean per-tenant step time, rollout / train / sync split,
decode tokens/s, peak GPU memory. Full numbers go to ``--out`` as JSON.

Usage (GPU): python -m benchmarks.e2e --shape qwen3-1.7b --tokenizer <model dir with a chat template> --out $OUT/e2e.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from benchmarks.common import QWEN3_VOCAB, write_random_model

from skyrl_clora.config import build_run_config
from skyrl_clora.main import compose_config
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.engine_stats import EngineStats
from skyrl_clora.sampler.requests import SamplingParams, derive_seed
from skyrl_clora.services import Services, build_services
from skyrl_clora.trainer.adapter_store import LRSchedule
from skyrl_clora.trainer.scheduler import TrainScheduler
from skyrl_clora.trainer.trainer import TrainBatch


@dataclass(frozen=True)
class Workload:
    prompt: int = 256
    response: int = 100
    observation: int = 32
    turns: int = 3
    prompts: int = 8
    samples: int = 8
    steps: int = 3
    # Prompt-prefix K/V kept by the engine: a 1.7B model's 128-token block is ~15 MB, and every episode's
    # history is reused by its next turn (the CPU default of 1 GiB would evict them at N=1 already).
    prefix_cache_mb: int = 32768
    # A tenant step (8 prompts once + 64 responses of 364 tokens, ~25k positions with shared prompts) in one
    # micro-batch: half the trainer's launches of 32-row micro-batches (RESULTS.md, Training: packed vs swap).
    max_tokens_per_microbatch: int = 32768
    overrides: tuple[str, ...] = ()  # further config overrides (--override), e.g. trainer.shared_prompts=true

    @property
    def max_input(self) -> int:
        return self.prompt + (self.turns - 1) * (self.response + self.observation)


@dataclass
class StepRecord:
    tenant: str
    step: int
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    generated_tokens: int


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


def run_config(model_dir: Path, workload: Workload, train_mode: str, tenants: int, device: str):
    overrides = [
        f"model.path={model_dir}", "model.dtype=bfloat16", f"clora.device={device}", f"clora.train_mode={train_mode}",
        f"+tenants={tenants}", f"clora.steps={workload.steps}", "clora.progress=false",
        f"recipe.max_input_length={workload.max_input}", f"recipe.max_generate_length={workload.response}",
        f"recipe.samples_per_prompt={workload.samples}", f"recipe.prompts_per_step={workload.prompts}",
        "sampler.prefill_block=128", "sampler.max_prefills_per_step=64", f"sampler.prefix_cache_mb={workload.prefix_cache_mb}",
        f"trainer.max_tokens_per_microbatch={workload.max_tokens_per_microbatch}", "lora.rank=16", "lora.max_rank=16",
        *workload.overrides,
    ]
    return build_run_config(compose_config(overrides))


async def episode(services: Services, tenant: str, session: str, prompt: list[int], workload: Workload,
                  generator: torch.Generator) -> tuple[list[int], list[int]]:
    """One multi-turn episode: returns the response ids (sampled turns and observations) and their loss mask."""
    context, response, mask = list(prompt), [], []
    for turn in range(workload.turns):
        params = SamplingParams(max_tokens=workload.response, temperature=1.0,
                                seed=derive_seed(0, f"{tenant}/{session}", len(context)))
        completion = await asyncio.wrap_future(services.engine.submit(context, tenant, params))
        response += completion.token_ids
        mask += [1] * len(completion.token_ids)
        context += completion.token_ids
        if turn + 1 < workload.turns:
            observation = torch.randint(0, 1000, (workload.observation,), generator=generator).tolist()
            response += observation
            mask += [0] * len(observation)
            context += observation
    return response, mask


async def experiment(services: Services, scheduler: TrainScheduler, tenant: str, seed: int, workload: Workload,
                     records: list[StepRecord]) -> None:
    generator = torch.Generator().manual_seed(seed)
    for step in range(1, workload.steps + 1):
        started = time.perf_counter()
        prompts = [torch.randint(0, 1000, (workload.prompt,), generator=generator).tolist() for _ in range(workload.prompts)]
        rows = [(index, prompt) for index, prompt in enumerate(prompts) for _ in range(workload.samples)]
        results = await asyncio.gather(*(episode(services, tenant, f"{seed}-{step}-{episode_index}", prompt, workload,
                                                 generator) for episode_index, (_, prompt) in enumerate(rows)))
        rollout_s = time.perf_counter() - started
        batch = TrainBatch(
            prompt_ids=[prompt for _, prompt in rows], response_ids=[r for r, _ in results],
            loss_masks=[m for _, m in results], rewards=torch.rand(len(rows), generator=generator).round().tolist(),
            group_ids=[f"{tenant}-{step}-{index}" for index, _ in rows], rollout_logprobs=None,
        )
        trained = time.perf_counter()
        weights, _ = await scheduler.train(tenant, batch)
        train_s = time.perf_counter() - trained
        _, sync_s = await services.sync.publish(tenant, weights)
        records.append(StepRecord(tenant, step, rollout_s, train_s, sync_s, time.perf_counter() - started,
                                  sum(sum(m) for _, m in results)))


def register(services: Services, run, tenant: str, seed: int) -> None:
    weights = init_adapter(services.trainer.layers, 16, 32.0, torch.Generator().manual_seed(seed))
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
    result = ModeResult(train_mode, len(names), 0.0, [services.cold_start_seconds])
    try:
        for name, seed in zip(names, seeds):
            register(services, run, name, seed)

        async def main() -> None:
            scheduler = services.train_scheduler(run)
            await asyncio.gather(*(experiment(services, scheduler, name, seed, workload, result.steps)
                                   for name, seed in zip(names, seeds)))
            result.train_passes_s = scheduler.pass_seconds

        asyncio.run(main())
    finally:
        services.shutdown()
    result.wall_s = time.perf_counter() - started
    result.engine = replace(services.engine.stats)
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
          f"{stats.prefill_tokens} prompt tokens computed, {stats.cached_prompt_tokens} from the prefix cache; "
          f"{stats.shared_prefix_positions / steps:.0f} key positions per decode step read from "
          f"a shared copy); engine thread busy {stats.busy_seconds:.1f} s, paused {stats.paused_seconds:.1f} s, idle "
          f"{stats.idle_seconds:.1f} s ({stats.idle_waits} waits of 1 ms or more, the longest "
          f"{stats.longest_idle_seconds:.2f} s); training passes {result.train_passes_s:.1f} s; allocator: peak "
          f"{result.peak_memory_gib:.1f} GiB allocated, {result.peak_reserved_gib:.1f} GiB reserved, "
          f"{result.alloc_retries} retries", flush=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def summarize(result: ModeResult) -> dict:
    steps = result.steps
    return {
        "mode": result.mode, "tenants": result.tenants, "wall_s": result.wall_s, "cold_start_s": result.cold_start_s,
        "step_s": statistics.mean(s.step_s for s in steps), "rollout_s": statistics.mean(s.rollout_s for s in steps),
        "train_s": statistics.mean(s.train_s for s in steps), "sync_s": statistics.mean(s.sync_s for s in steps),
        "decode_tokens_per_s": result.engine.generated_tokens / max(result.engine.decode_seconds, 1e-9),
        "peak_memory_gib": result.peak_memory_gib,
    }


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
    groups = [asdict(r) for r in serial] + [asdict(r) for r in concurrent.values()]
    path.write_text(json.dumps({"partial": True, "groups": groups}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=["swap", "packed"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--response", type=int, default=100)
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the table: profile 1-step experiments after the warm-up (the largest --tenants "
                             "concurrently, the first of --modes) and write the GPU-kernel and CPU tables beside --out")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (serial and concurrent alike), e.g. trainer.shared_prompts=true")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="also run every concurrent mode with these overrides, as mode+NAME (serial runs without), "
                             "e.g. carve32:trainer.sm_carveout=32")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    variants = {"": ()}
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        if not name or "=" not in overrides:
            parser.error(f"--variant {spec!r}: use NAME:KEY=VALUE[,KEY=VALUE]")
        variants[f"+{name}"] = tuple(overrides.split(","))
    labels = [mode + suffix for suffix in variants for mode in args.modes]
    workload = Workload(steps=args.steps, response=args.response, overrides=tuple(args.override))
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
        for n in sorted(set(args.tenants) | {1}, reverse=True):
            for mode in args.modes:
                run_and_release(model_dir, replace(workload, steps=1), mode, warm_names[:n], [0] * n, args.device,
                                f"warm-up {mode}")
        if args.profile:
            profile_experiment(model_dir, replace(workload, steps=1), args.modes[0], most, args.device, args.out)
            return
        serial: list[ModeResult] = []
        for name, seed in zip(names, seeds):
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
    rows = []
    for n in args.tenants:
        serial_wall = sum(r.wall_s for r in serial[:n])
        serial_steps = [s for r in serial[:n] for s in r.steps]
        decode = EngineStats(generated_tokens=sum(r.engine.generated_tokens for r in serial[:n]),
                             decode_seconds=sum(r.engine.decode_seconds for r in serial[:n]))
        rows.append({**summarize(ModeResult("serial", n, serial_wall, [c for r in serial[:n] for c in r.cold_start_s],
                                            serial_steps, decode, max(r.peak_memory_gib for r in serial[:n]))),
                     "throughput_vs_serial": 1.0})
        for label in labels:
            result = concurrent[(label, n)]
            rows.append({**summarize(result), "throughput_vs_serial": serial_wall / result.wall_s})
    one = {row["mode"]: row for row in rows if row["tenants"] == 1}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shape": args.shape, "workload": asdict(workload), "rows": rows}, indent=2) + "\n")
    print(f"{args.shape}: {workload}")
    print(f"{'mode':14} {'N':>2} {'wall s':>7} {'x serial':>8} {'step s':>7} {'vs N=1':>6} {'rollout':>7} {'vs N=1':>6} "
          f"{'train':>6} {'sync':>5} {'decode tok/s':>12} {'peak GiB':>8}")
    for row in rows:
        base = one.get(row["mode"])  # the same mode at N=1, when it ran
        step_vs = f"{row['step_s'] / base['step_s']:6.2f}" if base else f"{'-':>6}"
        rollout_vs = f"{row['rollout_s'] / base['rollout_s']:6.2f}" if base else f"{'-':>6}"
        print(f"{row['mode']:14} {row['tenants']:2d} {row['wall_s']:7.1f} {row['throughput_vs_serial']:8.2f} "
              f"{row['step_s']:7.2f} {step_vs} {row['rollout_s']:7.2f} "
              f"{rollout_vs} {row['train_s']:6.2f} {row['sync_s']:5.2f} "
              f"{row['decode_tokens_per_s']:12.0f} {row['peak_memory_gib']:8.1f}")


if __name__ == "__main__":
    main()
