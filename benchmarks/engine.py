"""Decode throughput of the embedded engine vs Hugging Face ``generate`` (+PEFT), side by side in one run.

A Qwen3-shaped model with random bf16 weights is built on the GPU. Each case submits ``batch`` requests of
``prompt`` random tokens and generates exactly ``new`` tokens each (no stop token), with the rows' adapters:
none (the base model), 1 adapter for every row, or 8 / 32 tenants mixed row by row (rank 16, all linear
layers). Reported per case: end-to-end tokens/s (generated tokens / wall time, prefill included), decode
tokens/s (tokens / time in decode steps) and the decode step time; the engine's base decode is also set
against the memory roofline: per step, all weights once plus every row's K/V read and written, over the
copy bandwidth measured in the same run. HF ``generate`` runs the same shapes on a second copy of the model
(base, PEFT with 1 adapter, PEFT with 8 adapters mixed via ``adapter_names``).

Usage (GPU): python -m benchmarks.engine --shape qwen3-1.7b --out $OUT/bench_engine.json
On the CPU (``--shape tiny``, small sizes) it runs as a smoke run: its figures say only that the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from benchmarks.common import (DEVICE, QWEN3_VOCAB, SHAPES, build_random_model, copy_bandwidth, qwen3_config,
                               random_adapter, sync)
from transformers import Qwen3ForCausalLM

from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import SamplingParams

def build_model(shape: str) -> Qwen3ForCausalLM:
    return build_random_model(qwen3_config(shape), DEVICE).eval()


def run_engine_case(engine: EngineThread, batch: int, prompt: int, new: int, adapters: list[str | None], seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, QWEN3_VOCAB, (prompt,), generator=generator).tolist() for _ in range(batch)]
    before = dict(vars(engine.stats))
    sync()
    started = time.perf_counter()
    futures = [engine.submit(ids, adapters[i % len(adapters)], SamplingParams(max_tokens=new, temperature=1.0, seed=i))
               for i, ids in enumerate(prompts)]
    results = [future.result(timeout=600) for future in futures]
    wall = time.perf_counter() - started
    assert all(len(r.token_ids) == new for r in results)
    after = vars(engine.stats)
    decode_s = after["decode_seconds"] - before["decode_seconds"]
    steps = after["decode_steps"] - before["decode_steps"]
    return {"tokens_per_s": batch * new / wall, "decode_tokens_per_s": batch * (new - 1) / decode_s,
            "decode_step_ms": 1e3 * decode_s / steps, "prefill_s": after["prefill_seconds"] - before["prefill_seconds"],
            "wall_s": wall}


def profile_case(engine: EngineThread, batch: int, prompt: int, new: int, table_path: Path) -> dict:
    """Runs one base-model case under ``torch.profiler``; writes the kernel table (by GPU time) to
    ``table_path`` and returns the GPU kernels launched per decode step and the GPU-busy share of the wall (on the
    CPU: the table by CPU time, and zeros)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    steps_before = engine.stats.decode_steps
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        case = run_engine_case(engine, batch, prompt, new, [None], seed=7)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    steps = engine.stats.decode_steps - steps_before
    table_path.write_text(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                                    row_limit=40))
    gpu_s = sum(e.device_time_total for e in events) / 1e6
    return {"gpu_kernels_per_decode_step": len(events) / max(1, steps), "gpu_busy_share": gpu_s / case["wall_s"]}


def run_hf_case(model, batch: int, prompt: int, new: int, adapter_names: list[str] | None) -> dict:
    input_ids = torch.randint(0, QWEN3_VOCAB, (batch, prompt), device=DEVICE)
    kwargs = {"adapter_names": adapter_names} if adapter_names is not None else {}
    generate = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0, pad_token_id=0)
    attention_mask = torch.ones_like(input_ids)
    warm_up = {**generate, "max_new_tokens": min(new, 8), "min_new_tokens": min(new, 8)}
    model.generate(input_ids=input_ids, attention_mask=attention_mask, **warm_up, **kwargs)  # the measured batch and prompt
    sync()
    started = time.perf_counter()
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate, **kwargs)
    sync()
    wall = time.perf_counter() - started
    assert output.shape[1] == prompt + new
    return {"tokens_per_s": batch * new / wall, "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    # Medians over repeats: a timed repeat can still pay a one-time cost after the warm-up, which a median of two
    # repeats does not leave out (RESULTS.md, Method).
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one base case at the smallest batch: kernels per decode step and the "
                             "top kernels by GPU time, written beside --out")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    model = build_model(args.shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    kv_token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    routing, layers = attach_engine_lora(model, num_slots=32, max_rank=16)
    rows = max(args.batches)
    started = time.perf_counter()
    engine = EngineThread(Engine(model, layers, EngineConfig(num_rows=rows, max_len=args.prompt + args.new, block_size=128,
                                                             max_prefills_per_step=64, cache_prefixes=False)))
    build_s = time.perf_counter() - started
    names = [f"tenant-{i}" for i in range(32)]
    for i, name in enumerate(names):
        engine.register_adapter(name, random_adapter(layers, 16, seed=i))
    cases = {"base": [None], "1 adapter": names[:1], "8 tenants mixed": names[:8], "32 tenants mixed": names}
    results: dict = {"shape": args.shape, "copy_bandwidth_GBps": bandwidth / 1e9, "engine_build_s": build_s,
                     "graph_capture_s": engine.stats.graph_capture_seconds, "engine": {}, "hf": {}}
    for batch in args.batches:
        for adapters in cases.values():  # warm-up: the first pass of a batch size pays one-time prefill costs
            run_engine_case(engine, batch, args.prompt, args.new, adapters, seed=999)
        for label, adapters in cases.items():
            runs = [run_engine_case(engine, batch, args.prompt, args.new, adapters, seed=r) for r in range(args.repeats)]
            results["engine"][f"{label} @ {batch}"] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(f"engine {label} @ {batch}: {results['engine'][f'{label} @ {batch}']}", flush=True)
        mean_context = args.prompt + args.new / 2
        step_bytes = weight_bytes + batch * mean_context * kv_token_bytes
        results["engine"][f"base @ {batch}"]["roofline_tokens_per_s"] = batch / (step_bytes / bandwidth)
    if args.profile:
        results["profile"] = profile_case(engine, min(args.batches), args.prompt, args.new,
                                          args.out.with_suffix(".profile.txt"))
        print(f"profile: {results['profile']}", flush=True)
    engine.shutdown()
    args.out.write_text(json.dumps(results, indent=2) + "\n")  # the engine's numbers survive a failing HF part
    del engine, model, layers, routing
    torch.cuda.empty_cache()
    if args.hf:
        from peft import LoraConfig, get_peft_model

        hf_model = build_model(args.shape)
        for batch in args.batches:
            results["hf"][f"base @ {batch}"] = run_hf_case(hf_model, batch, args.prompt, args.new, None)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        peft_model = get_peft_model(hf_model, lora, adapter_name="tenant-0")
        for i in range(1, 8):
            peft_model.add_adapter(f"tenant-{i}", lora)
        peft_model.set_adapter("tenant-0")
        peft_model.eval()  # PEFT takes adapter_names only in eval mode
        batch = min(args.batches)
        results["hf"][f"PEFT 1 adapter @ {batch}"] = run_hf_case(peft_model, batch, args.prompt, args.new, None)
        mixed = [f"tenant-{i % 8}" for i in range(batch)]
        results["hf"][f"PEFT 8 tenants mixed @ {batch}"] = run_hf_case(peft_model, batch, args.prompt, args.new, mixed)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{args.shape}, {args.prompt} prompt + {args.new} new tokens per request, copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s, engine build {build_s:.1f} s (graph capture {results['graph_capture_s']:.1f} s)")
    print(f"{'case':28} {'tok/s e2e':>10} {'decode tok/s':>13} {'step ms':>8} {'vs base':>8} {'vs HF base':>10}")
    for key, row in results["engine"].items():
        label, batch = key.rsplit(" @ ", 1)
        base = results["engine"][f"base @ {batch}"]
        hf = results["hf"].get(f"base @ {batch}")
        print(f"engine {key:21} {row['tokens_per_s']:10.0f} {row['decode_tokens_per_s']:13.0f} {row['decode_step_ms']:8.2f} "
              f"{row['decode_tokens_per_s'] / base['decode_tokens_per_s']:8.2f} "
              f"{row['tokens_per_s'] / hf['tokens_per_s'] if hf else float('nan'):10.1f}")
        if "roofline_tokens_per_s" in row:
            print(f"  roofline {row['roofline_tokens_per_s']:.0f} tok/s: decode at "
                  f"{row['decode_tokens_per_s'] / row['roofline_tokens_per_s']:.0%} of it")
    for key, row in results["hf"].items():
        print(f"HF {key:25} {row['tokens_per_s']:10.0f}")


if __name__ == "__main__":
    main()
