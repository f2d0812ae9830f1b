"""A :class:`Scheduler` on its own (no model, no engine) for the tests of admission and adapter-slot decisions:
built over a tiny multi-LoRA layer's device slots and a block pool that never runs short, requests queued for a
tenant, and a plan's requests started, or run for one decode step and finished, as the engine would report them."""

from __future__ import annotations

import concurrent.futures

import torch
from torch import nn

from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.block_manager import BlockManager
from skyrl_clora.sampler.requests import PrefillPlan, QueuedRequest, SamplingParams
from skyrl_clora.sampler.scheduler import Scheduler


def scheduler_for(tenants: list[str], num_rows: int, admission: str, num_slots: int | None = None,
                  slot_credit: float = 0.0) -> Scheduler:
    """A scheduler over ``num_rows`` rows and ``num_slots`` device slots (default: one per tenant) for ``tenants`` (at
    version 0), a pool that never runs short, with ``slot_credit``."""
    layers = {"proj": MultiLoRALinear(nn.Linear(4, 4), num_slots=num_slots or len(tenants), max_rank=2,
                                      routing=LoRARouting(), trainable=False)}
    adapters = AdapterSlots(layers, pin=False)
    for name in tenants:
        adapters.register(name)
        adapters.publish(name, init_adapter(layers, 2, 4.0, torch.Generator().manual_seed(0)), 0)
    pool = BlockManager(4096, 4, num_rows, max_blocks_per_row=4, cache_prefixes=False)
    return Scheduler(num_rows, adapters, pool, max_prefills_per_step=num_rows, reuse_decode_kv=False,
                     admission=admission, slot_credit=slot_credit)


def enqueue(scheduler: Scheduler, tenant: str, prompt_len: int = 6) -> QueuedRequest:
    """Queues one request of ``tenant`` (a prompt of ``prompt_len`` tokens, 4 tokens at most) and returns it."""
    request = QueuedRequest(list(range(prompt_len)), tenant, SamplingParams(max_tokens=4),
                            concurrent.futures.Future())
    scheduler.enqueue(request)
    return request


def run_one_step(scheduler: Scheduler, plan: PrefillPlan) -> None:
    """``plan``'s requests run one decode step and finish (their rows freed)."""
    for req, start in zip(plan.requests, plan.starts):
        scheduler.prefilled(req, start)
    scheduler.decode_launched()
    for req in plan.requests:
        scheduler.release(req.row)


def start(scheduler: Scheduler, plan: PrefillPlan) -> None:
    """``plan``'s requests start running (and keep their rows)."""
    for req, start_at in zip(plan.requests, plan.starts):
        scheduler.prefilled(req, start_at)
