"""The engine's admission and KV-pool policies under many tenants, simulated on the host: the real
:class:`~skyrl_clora.sampler.scheduler.Scheduler` (fair admission, adapter slots, the block pool with its prefix
cache and kept turns) driven through one step's rollouts of ``--tenants`` tenants at benchmarks.e2e's standard
workload (``--prompts`` GRPO groups of ``--samples`` episodes a tenant, ``--prompt``-token prompts, 3 turns of
``--lengths`` sampled tokens with 32 observation tokens between them), without a model: each decode step adds one
token to every running row, each finished turn's next turn is queued one step later.

It counts what the policies decide: prompt tokens prefilled against the distinct ones (each group's prompt once,
each later turn's observation and last sampled token; benchmarks.e2e's recompute), preemptions, decode steps and
prefill rounds, and a modelled engine time from per-step costs fitted to the H200 (``--decode-ms`` +
``--decode-ms-per-kpos`` per thousand key positions the running rows hold, ``--prefill-ms`` +
``--prefill-ms-per-token`` per prompt token computed; the defaults fit benchmarks.e2e's N=64 run, RESULTS.md). At
N=64 with the H200's 4,300-block pool it reproduces the recompute measured there with bb6e09e's scheduler (7.24x
with reservations, 7.67x without, against 7.30x and 7.69x on the H200). The model's times rank policies; the GPU's
walls decide.

Usage: python -m benchmarks.admission --tenants 64 --kv-blocks 4300 --reserve on off --out admission.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from benchmarks.workloads import Lengths, counter_rng, distinct_prompt_tokens, parse_lengths
from torch import nn

from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.block_manager import BlockManager
from skyrl_clora.sampler.fair_share import slot_credit
from skyrl_clora.sampler.requests import QueuedRequest, SamplingParams
from skyrl_clora.sampler.scheduler import Scheduler

TURNS, OBSERVATION, BLOCK, MAX_LEN = 3, 32, 128, 2048  # benchmarks.e2e's turns, observation and block size


@dataclass
class Episode:
    """One episode (``index``: its number in the run): its tenant, the context so far, the turn it is at and each
    turn's drawn length."""

    index: int
    tenant: str
    context: list[int]
    lengths: list[int]
    turn: int = 0


@dataclass
class Outcome:
    reserve_kv: bool
    decode_steps: int = 0
    prefill_rounds: int = 0
    prompt_tokens_computed: int = 0
    distinct_prompt_tokens: int = 0
    preemptions: int = 0
    peak_running_rows: int = 0
    modelled_engine_s: float = 0.0
    host_s: float = 0.0
    recompute: float = field(init=False, default=0.0)


def episodes(tenants: int, prompts: int, samples: int, prompt: int, lengths: Lengths) -> list[Episode]:
    """Every tenant's episodes of one step, seeded as benchmarks.e2e seeds them (tenant seed, step 1, episode,
    turn); a group's samples share their prompt."""
    made = []
    for tenant in range(tenants):
        seed = tenant + 1
        for group in range(prompts):
            tokens = counter_rng(seed, 1, group, 0, 2).integers(0, 1000, prompt).tolist()
            for sample in range(samples):
                index = group * samples + sample
                made.append(Episode(len(made), f"tenant-{tenant}", list(tokens),
                                    [lengths.draw(seed, 1, index, turn) for turn in range(TURNS)]))
    return made


def simulate(args: argparse.Namespace, reserve_kv: bool) -> Outcome:
    """One step's rollouts of every tenant through a scheduler over ``args.kv_blocks`` blocks (module docstring)."""
    names = [f"tenant-{i}" for i in range(args.tenants)]
    layers = {"proj": MultiLoRALinear(nn.Linear(4, 4), num_slots=args.tenants, max_rank=2, routing=LoRARouting(),
                                      trainable=False)}
    adapters = AdapterSlots(layers, pin=False)
    for name in names:
        adapters.register(name)
        adapters.publish(name, init_adapter(layers, 2, 4.0, torch.Generator().manual_seed(0)), 0)
    rows = args.tenants * args.prompts * args.samples
    pool = BlockManager(args.kv_blocks, BLOCK, rows, MAX_LEN // BLOCK, cache_prefixes=True)
    scheduler = Scheduler(rows, adapters, pool, max_prefills_per_step=64, reuse_decode_kv=True, prefill_wait_steps=8,
                          admission="fair", slot_credit=slot_credit(MAX_LEN), reserve_kv=reserve_kv)
    outcome = Outcome(reserve_kv)
    outcome.distinct_prompt_tokens = distinct_prompt_tokens(args.tenants * args.prompts, args.samples, args.prompt,
                                                            TURNS, OBSERVATION)
    episode_of: dict[int, Episode] = {}

    def queue(episode: Episode) -> None:
        request = QueuedRequest(list(episode.context), episode.tenant,
                                SamplingParams(max_tokens=episode.lengths[episode.turn]), concurrent.futures.Future())
        episode_of[id(request)] = episode
        scheduler.enqueue(request)

    for episode in episodes(args.tenants, args.prompts, args.samples, args.prompt, args.lengths):
        queue(episode)
    drawn: dict[int, list] = {}  # row -> [request, tokens drawn]
    arriving: list[Episode] = []
    started = time.perf_counter()
    while drawn or arriving or not scheduler.idle():
        for episode in arriving:
            queue(episode)
        arriving = []
        plan = scheduler.schedule_prefill()
        if plan.requests:
            computed = sum(len(req.prompt_ids) - start for req, start in zip(plan.requests, plan.starts))
            outcome.prefill_rounds += 1
            outcome.prompt_tokens_computed += computed
            outcome.modelled_engine_s += (args.prefill_ms + args.prefill_ms_per_token * computed) / 1e3
        for req, start in zip(plan.requests, plan.starts):
            scheduler.prefilled(req, start)
            drawn[req.row] = [req, 1]  # the prefill samples the first token
        if not drawn:
            continue
        running = np.array(sorted(drawn))
        needed = np.array([min((len(drawn[row][0].prompt_ids) + drawn[row][1]) // BLOCK + 1, MAX_LEN // BLOCK)
                           for row in running.tolist()])
        preempted, failed = scheduler.make_room(running, needed)
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: a row outgrew the whole pool; raise --kv-blocks")
        for row in preempted:
            del drawn[row]
        outcome.preemptions += len(preempted)
        outcome.peak_running_rows = max(outcome.peak_running_rows, len(drawn))
        positions = sum(len(req.prompt_ids) + count for req, count in drawn.values())
        outcome.modelled_engine_s += (args.decode_ms + args.decode_ms_per_kpos * positions / 1e3) / 1e3
        scheduler.decode_launched()
        outcome.decode_steps += 1
        for row in list(drawn):
            req, count = drawn[row]
            drawn[row][1] = count = count + 1
            if count < req.params.max_tokens:
                continue
            del drawn[row]
            episode = episode_of.pop(id(req))
            req.output = counter_rng(episode.index, episode.turn, 3).integers(0, 1000, count).tolist()
            scheduler.finish(req)
            episode.context += req.output
            episode.turn += 1
            if episode.turn < TURNS:
                episode.context += counter_rng(episode.index, episode.turn, 4).integers(0, 1000, OBSERVATION).tolist()
                arriving.append(episode)
    outcome.host_s = time.perf_counter() - started
    outcome.recompute = outcome.prompt_tokens_computed / outcome.distinct_prompt_tokens
    return outcome


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=next(line for line in __doc__.splitlines() if line.startswith("Usage")))
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="GRPO groups per tenant step")
    parser.add_argument("--samples", type=int, default=8, help="episodes per group")
    parser.add_argument("--prompt", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--lengths", type=parse_lengths, default=parse_lengths("longtail"),
                        help="each turn's sampled length (benchmarks.e2e's specs; default longtail)")
    parser.add_argument("--kv-blocks", type=int, default=4300, help="KV blocks of 128 tokens (the H200's at N=64)")
    parser.add_argument("--reserve", nargs="+", choices=["on", "off"], default=["on", "off"],
                        help="sampler.reserve_kv values to run")
    parser.add_argument("--decode-ms", type=float, default=1.5)
    parser.add_argument("--decode-ms-per-kpos", type=float, default=0.05)
    parser.add_argument("--prefill-ms", type=float, default=8.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0058)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    outcomes = [simulate(args, reserve == "on") for reserve in args.reserve]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: value.spec if isinstance(value, Lengths) else str(value) if isinstance(value, Path) else value
                for key, value in vars(args).items()}
    args.out.write_text(json.dumps({"settings": settings, "rows": [asdict(o) for o in outcomes]}, indent=2) + "\n")
    print(f"{args.tenants} tenants, {args.kv_blocks} blocks, lengths {args.lengths.spec}")
    print(f"{'reserve_kv':>10} {'recompute':>9} {'preempted':>9} {'decode steps':>12} {'prefill rounds':>14} "
          f"{'peak rows':>9} {'modelled s':>10}")
    for o in outcomes:
        print(f"{str(o.reserve_kv):>10} {o.recompute:9.2f} {o.preemptions:9d} {o.decode_steps:12d} "
              f"{o.prefill_rounds:14d} {o.peak_running_rows:9d} {o.modelled_engine_s:10.1f}")


if __name__ == "__main__":
    main()
