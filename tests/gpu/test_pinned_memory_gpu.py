"""The page-locked host pool on the GPU: its tensors are pinned at the size asked for and copy asynchronously both
ways, a pool block is not handed out again while an adapter slot's write from it may be queued, and the trainer's
AdapterStore holds each tenant's state in blocks of exactly ``host_bytes``. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from skyrl_clora.device import pinned_memory
from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.device.pinned_memory import PAGE_BYTES, PinnedPool
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.lr_schedule import LRSchedule

pytestmark = pytest.mark.gpu


def test_pool_tensors_are_pinned_and_copy_asynchronously_both_ways() -> None:
    pool = PinnedPool()
    numel = 3 * PAGE_BYTES // 4 + 5
    host, back = pool.empty(numel, torch.float32), pool.empty(numel, torch.float32)
    assert host.is_pinned() and back.is_pinned() and pool.held_bytes() == 8 * PAGE_BYTES
    host.copy_(torch.randn(numel))
    device = torch.empty(numel, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        device.copy_(host, non_blocking=True)
        device.mul_(2.0)
        back.copy_(device, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, host * 2.0)


def test_a_published_copy_stays_out_of_the_pool_until_its_slot_write_is_done(
        monkeypatch: pytest.MonkeyPatch, micro_model_dir) -> None:
    pool = PinnedPool()
    monkeypatch.setattr(pinned_memory, "_process_pool", lambda: pool)
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).cuda()
    _, layers = attach_engine_lora(model, num_slots=2, max_rank=16)
    slots = AdapterSlots(layers, pin=True)
    slots.register("a")
    slots.assign("a", busy=set())
    first, second = (init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(seed)) for seed in (0, 1))
    slots.publish("a", slots.host_copy(first), 1)  # resident: written into its slot asynchronously
    address = next(iter(slots._latest["a"][0].a.values())).data_ptr()
    slots.evict("a")
    slots.publish("a", slots.host_copy(second), 2)  # not resident: version 1's copy is dropped, no write queued
    assert next(iter(slots.host_copy(first).a.values())).data_ptr() != address, \
        "a block was handed out again while its write into a slot may be queued"
    torch.cuda.synchronize()
    slots.assign("a", busy=set())
    slots.load("a")  # a later write: the finished one is let go
    assert next(iter(slots.host_copy(first).a.values())).data_ptr() == address, "the pool must reuse the block"
    served = slots.read("a", 8, 16.0)
    assert all(torch.equal(served.a[path].cpu(), second.a[path].to(served.a[path].dtype)) for path in second.a)


def test_adapter_store_state_takes_host_bytes_of_page_locked_memory(monkeypatch: pytest.MonkeyPatch,
                                                                    micro_model_dir) -> None:
    pool = PinnedPool()
    monkeypatch.setattr(pinned_memory, "_process_pool", lambda: pool)
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).cuda()
    _, layers = attach_multi_lora(model, num_slots=1, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=1)
    for index, rank in enumerate((8, 16)):
        store.register(f"t{index}", init_adapter(layers, rank, 16.0, torch.Generator().manual_seed(index)),
                       LRSchedule(base_lr=1e-3), seed=index)
    pages = sum(-(-store._numel(rank) * size // PAGE_BYTES) * PAGE_BYTES
                for rank in (8, 16) for size in (4, 4, 4, 4, 4))  # four fp32 tables and fp32 weights a tenant
    assert store.dtype == torch.float32 and pool.held_bytes() == pages
    assert pages < 1.01 * (store.host_bytes(8) + store.host_bytes(16)) + 10 * PAGE_BYTES
    assert all(table.is_pinned() for state in store.tenants.values() for table in state.flat.values())
