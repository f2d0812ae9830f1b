"""Host time of one engine decode step at R running rows, without the model or the sampler's kernel (CPU).

On the GPU a decode step is a graph replay plus the sampler's kernel, both queued in microseconds; the rest
is the engine thread's own Python (choosing the rows, staging the inputs, RNG draws, accepting tokens,
stop and length checks), paid after every step's synchronisation and, in concurrent runs, while holding the
GIL the trainer's thread also needs. This times that part alone: an Engine (no thread: this one drives its rounds) over a one-layer model whose
``runner.prefill`` and ``runner.decode`` return fixed logits and whose ``draw_rows`` returns fixed tokens, every
row running (GRPO groups of 8 rows sharing their prompt's blocks, as the engine's shared-prefix reads see them),
nothing waiting, median of ``--repeats`` batches of ``--steps`` steps. With ``--waiting T``: each running group has an
adapter of its own holding one of the engine's ``R / 8`` device slots, and T more tenants queue a group of requests
each whose adapters hold no slot (hundreds of tenants on a few slots), so every step also runs an admission round
over them (``--admission``), admitting none.

Usage: python -m benchmarks.engine_host --rows 64 512 --out outputs/bench_engine_host.json
       python -m benchmarks.engine_host --rows 256 --waiting 224 --admission fair --out outputs/bench_engine_host.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import skyrl_clora.sampler.engine as engine_module
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.fair_share import ADMISSIONS
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import QueuedRequest, SamplingParams
from skyrl_clora.sampler.sampling import DrawnTokens

PROMPT = 300
VOCAB = 512
GROUP = 8  # rows per GRPO group: one prompt


def step_ms(rows: int, steps: int, repeats: int, waiting: int = 0, admission: str = "fifo") -> float:
    """Median milliseconds of one ``Engine.step`` (no publish: launching a decode step, accepting the one before)
    with ``rows`` running rows (a multiple of :data:`GROUP`) and, with ``waiting``, that many tenants' groups waiting
    for a device slot (module docstring)."""
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM(config)
    groups = rows // GROUP
    routing, layers = attach_engine_lora(model, num_slots=groups if waiting else 8, max_rank=8)
    admission_steps = 2  # the groups' first requests, then the others
    max_len = PROMPT + admission_steps + steps * (repeats + 1) + 16
    engine = Engine(model, layers, EngineConfig(num_rows=rows + waiting * GROUP, max_len=max_len,
                                                max_prefills_per_step=rows, block_size=16, cuda_graphs=False,
                                                share_prefix_reads=True, admission=admission))
    names = [f"group-{g}" for g in range(groups)] + [f"waiting-{t}" for t in range(waiting)] if waiting else []
    weights = init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(0))
    for name in names:
        engine.adapters.register(name)
        engine.adapters.publish(name, weights, 0)
    logits = torch.randn(rows, VOCAB)
    engine.runner.prefill = lambda jobs: list(logits[: len(jobs)])
    engine.runner.decode = lambda span: logits[:span]
    tokens, logprobs = torch.full((rows,), 7), torch.full((rows,), -1.5)
    original = engine_module.draw_rows
    engine_module.draw_rows = lambda logits, temperature, top_p, uniform: DrawnTokens(tokens[: len(temperature)],
                                                                                       logprobs[: len(temperature)])
    try:
        prompts = [[(group + i) % VOCAB for i in range(PROMPT)] for group in range(rows // GROUP)]
        # Each group's first request is prefilled (its prompt blocks keyed) before the others, which then adopt
        # its whole prompt blocks, as a GRPO group's later samples do in the engine.
        for first in (True, False):
            for index in range(rows):
                if (index % GROUP == 0) == first:
                    params = SamplingParams(max_tokens=10**6, seed=index, stop_token_ids=(0,))
                    adapter = names[index // GROUP] if names else None
                    engine.scheduler.enqueue(QueuedRequest(list(prompts[index // GROUP]), adapter, params,
                                                           concurrent.futures.Future()))
            engine.step()
        if engine.running_rows() != rows:
            raise RuntimeError(f"{engine.running_rows()} of {rows} rows running after admission")
        for name in names[groups:]:
            for sample in range(GROUP):
                params = SamplingParams(max_tokens=8, seed=sample)
                prompt = [(len(name) + sample + i) % VOCAB for i in range(PROMPT)]
                engine.scheduler.enqueue(QueuedRequest(prompt, name, params, concurrent.futures.Future()))
        engine.step()
        if engine.running_rows() != rows:
            raise RuntimeError(f"{engine.running_rows()} rows running with {waiting} tenants waiting; expected {rows}")
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times.append(1e3 * (time.perf_counter() - started) / steps)
        return statistics.median(times)
    finally:
        engine_module.draw_rows = original


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512], help=f"running rows (multiples of {GROUP})")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--waiting", type=int, default=0, metavar="T",
                        help="tenants whose requests wait for a device slot (module docstring)")
    parser.add_argument("--admission", choices=ADMISSIONS, default="fifo", help="the engine's admission order")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_engine_host.json"))
    args = parser.parse_args(argv)
    if any(rows < GROUP or rows % GROUP for rows in args.rows):
        parser.error(f"--rows: give multiples of {GROUP}")
    torch.set_num_threads(1)
    results = {}
    for rows in args.rows:
        results[rows] = step_ms(rows, args.steps, args.repeats, args.waiting, args.admission)
        print(f"rows {rows:4d}, {args.waiting} tenants waiting ({args.admission}): {results[rows]:.3f} ms of host time "
              "per decode step", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host_ms_per_decode_step": results, "steps": args.steps, "repeats": args.repeats,
                                    "waiting_tenants": args.waiting, "admission": args.admission}, indent=2) + "\n")


if __name__ == "__main__":
    main()
