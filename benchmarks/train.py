"""Trainer throughput for 8 tenants on a Qwen3-shaped model (``--shape``, default Qwen3-1.7B): swap one by one (with and without
prefetching the next tenant on the side stream, and with each GRPO group's prompt computed once per
micro-batch: ``Trainer.shared_prefix``) vs one packed pass, side by side in one run. With ``--hf-baseline``,
swap on Hugging Face's own RMSNorm / SwiGLU modules runs first (before the model's modules are fused), the
baseline of the trainer's fused element-wise ops.

The model has random bf16 weights built on the GPU (no checkpoint), LoRA rank 16 on every linear layer of
the decoder. Workloads (per tenant, per round): ``gsm8k`` -- 8 prompts x 8 samples, prompts ~256 tokens and
responses ~300 tokens (the GSM8K-agentic shape of issue 5); ``small`` -- 8 sequences of 256 + 256 tokens;
``tiny`` -- 2 prompts x 2 samples of 8 + 8 tokens (with ``--shape tiny``: a CPU run checking that the script runs).
A round trains every tenant once; each mode runs ``--warmup`` rounds, then ``--repeats`` timed rounds
(medians reported). One more round per mode, with a device synchronisation around each phase, splits
the time into phases (that round is not in the medians). MFU: a round's FLOP (:func:`benchmarks.common.train_pass_flop`
of each tenant's batch, prompts once per group in the shared-prompts mode) over its median time and
``--peak-tflops``. Prints one table and writes bench_train.json.

Usage: python -m benchmarks.train --out $OUT [--shape qwen3-1.7b] [--workloads gsm8k,small] [--hf-baseline] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from skyrl.train.config import AlgorithmConfig
from benchmarks.common import (DEVICE, H200_BF16_TFLOPS, SHAPES, build_random_model, device_name, peak_memory_gib,
                               qwen3_config, reset_peak_memory, sync, train_pass_flop)

import skyrl_clora.trainer.trainer as trainer_module
from skyrl_clora.device.cuda_settings import avoid_cudnn_attention
from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.fused_modules import FusedRMSNorm, fuse_elementwise_modules
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings

TENANTS = 8
RANK = 16
HF_BASELINE = "swap, HF element-wise"  # swap mode on Hugging Face's own RMSNorm / SwiGLU modules
SHARED = "swap, shared prompts"  # swap mode computing each GRPO group's prompt once per micro-batch
MODES = ("swap", SHARED, "swap+prefetch", "packed")
WORKLOADS = ("gsm8k", "small", "tiny")


def make_batch(workload: str, generator: torch.Generator) -> TrainBatch:
    """One tenant's batch of ``workload`` with random tokens, lengths, rewards (fixed by ``generator``)."""
    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    prompts, responses, groups = [], [], []
    if workload == "gsm8k":
        for prompt_index in range(8):
            prompt = torch.randint(0, 150000, (randint(224, 288),), generator=generator).tolist()
            for _ in range(8):
                prompts.append(prompt)
                responses.append(torch.randint(0, 150000, (randint(200, 400),), generator=generator).tolist())
                groups.append(f"p{prompt_index}")
    else:
        count, length = (8, 256) if workload == "small" else (4, 8)
        for index in range(count):
            prompts.append(torch.randint(0, 150000, (length,), generator=generator).tolist())
            responses.append(torch.randint(0, 150000, (length,), generator=generator).tolist())
            groups.append(f"p{index // (count // 2)}")
    rewards = [float(torch.rand(1, generator=generator) > 0.5) for _ in prompts]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      rewards=rewards, group_ids=groups, rollout_logprobs=None)


@contextmanager
def phase_timers(trainer: Trainer, totals: dict[str, float]) -> Iterator[None]:
    """Wraps the trainer's phases with device-synchronised timers (seconds summed into ``totals``)."""
    store = trainer.store
    originals: list[tuple[object, str, Callable]] = []

    def wrap(owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            sync()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            sync()
            totals[label] += time.perf_counter() - started
            return result

        originals.append((owner, name, original))
        setattr(owner, name, timed)

    wrap(store, "swap_in", "swap in (incl. wait for prefetch)")
    wrap(store, "prefetch", "prefetch issue")
    wrap(store, "swap_out", "swap out")
    wrap(store, "wait", "wait for host state")
    wrap(trainer_module, "build_pass_rows", "advantages + batch to device")
    wrap(trainer, "_logprobs", "forward (decoder + LM head)")
    wrap(trainer_module, "adamw_slot", "AdamW")
    wrap(torch.Tensor, "backward", "loss backward")
    try:
        yield
    finally:
        for owner, name, original in reversed(originals):
            setattr(owner, name, original)


def run_round(trainer: Trainer, mode: str, names: list[str], batches: dict[str, TrainBatch]) -> None:
    """Trains every tenant once: one packed pass, or swap steps (``mode`` "swap+prefetch" prefetches the
    next tenant; the other modes are plain swap steps)."""
    if mode == "packed":
        trainer.train_packed([(name, batches[name]) for name in names])
        return
    for index, name in enumerate(names):
        upcoming = names[(index + 1) % len(names)] if mode == "swap+prefetch" else None
        trainer.train_step(name, batches[name], prefetch=upcoming)


def profile_round(trainer: Trainer, mode: str, names: list[str], batches: dict[str, TrainBatch], path: Path) -> None:
    """One round of ``mode`` under ``torch.profiler``: writes its top GPU kernels, CPU ops and GPU ops by input
    shapes to ``path`` (on the CPU: CPU ops, and CPU ops by input shapes)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), record_shapes=True) as prof:
        run_round(trainer, mode, names, batches)
        sync()
    averages = prof.key_averages()
    by_shape = prof.key_averages(group_by_input_shape=True)
    device_key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.write_text((averages.table(sort_by="self_cuda_time_total", row_limit=40) + "\n" if cuda else "")
                    + averages.table(sort_by="self_cpu_time_total", row_limit=25) + "\n"
                    + by_shape.table(sort_by=device_key, row_limit=60, max_name_column_width=40,
                                     max_shapes_column_width=120))


def host_profile_round(trainer: Trainer, mode: str, names: list[str], batches: dict[str, TrainBatch], path: Path) -> None:
    """One round of ``mode`` under ``cProfile`` (Python functions' own and cumulative host time; time blocked in
    a device synchronisation counts to the function that synchronised): writes both tables to ``path``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    run_round(trainer, mode, names, batches)
    sync()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    path.write_text(text.getvalue())


def gib(value: float | None) -> str:
    """A peak memory in GiB for the tables ("-": not measured)."""
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_train"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--workloads", default="gsm8k,small", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=-1,
                        help="> 0: micro-batches of rows computing at most this many tokens (--micro-batch-size ignored)")
    parser.add_argument("--hf-baseline", action="store_true",
                        help="first measure swap on Hugging Face's own RMSNorm / SwiGLU modules")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="modes to measure (swap always, as the baseline; the profiles cover only the modes named)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one round per mode (after its timed rounds): writes <workload>.<mode>.kernels.txt (mode without spaces, commas as dashes)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="the MFU's denominator")
    parser.add_argument("--host-profile", action="store_true",
                        help="also run one round per mode under cProfile: writes <workload>.<mode>.host.txt")
    args = parser.parse_args(argv)
    avoid_cudnn_attention()  # the process setting the embedded backend's runs have (build_services)
    workloads = args.workloads.split(",")
    if not set(workloads) <= set(WORKLOADS):
        parser.error(f"--workloads {args.workloads}: choose from {', '.join(WORKLOADS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = build_random_model(qwen3_config(args.shape), DEVICE)
    model.train()
    routing, layers = attach_multi_lora(model, num_slots=TENANTS, max_rank=RANK, trainable=True)
    store = AdapterStore(layers, num_slots=TENANTS)
    names = [f"tenant-{i}" for i in range(TENANTS)]
    for index, name in enumerate(names):
        weights = init_adapter(layers, RANK, 2.0 * RANK, torch.Generator().manual_seed(index))
        store.register(name, weights, LRSchedule(base_lr=1e-5 * (index + 1)), seed=index)
    # With the hf baseline, Hugging Face's own RMSNorm / SwiGLU modules for it (run first), then fused.
    trainer = Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False),
                                                                     OptimizerConfig(),
                      micro_batch_size=args.micro_batch_size, max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                      fused_elementwise=not args.hf_baseline))
    print(f"model built in {time.perf_counter() - started:.1f}s: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
          f"parameters, {len(layers)} LoRA layers, rank {RANK}, {device_name()}", flush=True)

    results = []
    # The baseline on Hugging Face's own modules for every workload first, then the fused modules for the rest.
    plan = [(workload, HF_BASELINE) for workload in workloads if args.hf_baseline]
    modes = ["swap"] + [mode for mode in args.modes if mode != "swap"]
    plan += [(workload, mode) for workload in workloads for mode in modes]
    for workload, mode in plan:
        if mode != HF_BASELINE and not any(isinstance(m, FusedRMSNorm) for m in model.modules()):
            fuse_elementwise_modules(model)
        trainer.shared_prefix = mode == SHARED
        generator = torch.Generator().manual_seed(1)
        batches = {name: make_batch(workload, generator) for name in names}
        tokens = sum(len(p) + len(r) for b in batches.values() for p, r in zip(b.prompt_ids, b.response_ids))
        flop = sum(train_pass_flop(model.config, RANK, [len(p) for p in b.prompt_ids], [len(r) for r in b.response_ids],
                                   b.group_ids, trainer.shared_prefix) for b in batches.values())
        for _ in range(args.warmup):
            run_round(trainer, mode, names, batches)
        sync()
        reset_peak_memory()
        seconds = []
        for _ in range(args.repeats):
            round_started = time.perf_counter()
            run_round(trainer, mode, names, batches)
            sync()
            seconds.append(time.perf_counter() - round_started)
        peak = peak_memory_gib()
        phases: dict[str, float] = defaultdict(float)
        with phase_timers(trainer, phases):
            sync()
            phase_started = time.perf_counter()
            run_round(trainer, mode, names, batches)
            phases["round (synchronised phases)"] = time.perf_counter() - phase_started
        stem = f"{workload}.{mode.replace(' ', '').replace(',', '-')}"
        if args.profile and mode in args.modes:
            profile_round(trainer, mode, names, batches, args.out / f"{stem}.kernels.txt")
        if args.host_profile and mode in args.modes:
            host_profile_round(trainer, mode, names, batches, args.out / f"{stem}.host.txt")
        median = statistics.median(seconds)
        row = {"workload": workload, "mode": mode, "round_s": median, "round_s_all": seconds,
               "tokens_per_round": tokens, "tokens_per_s": tokens / median, "flop_per_round": flop,
               "mfu": flop / median / (args.peak_tflops * 1e12), "peak_gib": peak,
               "phases_s": dict(phases)}
        results.append(row)
        print(f"{workload:>6} {mode:>21}: {median:.3f}s/round ({seconds}), {tokens / median:,.0f} tok/s, "
              f"peak {gib(peak)} GiB; phases {json.dumps({k: round(v, 3) for k, v in phases.items()})}", flush=True)

    print(f"\n{'workload':>8} {'mode':>21} {'s/round':>8} {'tokens/s':>10} {'vs swap':>8} {'MFU':>6} {'peak GiB':>9}")
    for row in results:
        swap = next(r for r in results if r["workload"] == row["workload"] and r["mode"] == "swap")
        row["speedup_vs_swap"] = swap["round_s"] / row["round_s"]
        print(f"{row['workload']:>8} {row['mode']:>21} {row['round_s']:>8.3f} {row['tokens_per_s']:>10,.0f} "
              f"{row['speedup_vs_swap']:>7.2f}x {row['mfu']:>6.1%} {gib(row['peak_gib']):>9}")
    for workload in workloads:
        if args.hf_baseline:
            row = next(r for r in results if r["workload"] == workload and r["mode"] == HF_BASELINE)
            print(f"{workload}: swap with the fused element-wise ops runs {row['speedup_vs_swap'] ** -1:.2f}x the "
                  "throughput of swap on Hugging Face's modules")
    report = {"device": device_name(), "torch": torch.__version__, "tenants": TENANTS, "rank": RANK,
              "peak_tflops": args.peak_tflops,
              "micro_batch_size": args.micro_batch_size, "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
              "repeats": args.repeats, "warmup": args.warmup, "rows": results}
    (args.out / "bench_train.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
