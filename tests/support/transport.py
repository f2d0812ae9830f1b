"""Where a tenant's weights travel inside the trainer, as reusable checks: the AdapterStore's swaps (every table
of both tenants through one slot) and the train scheduler (each tenant gets back its own stored weights).
Used by ``trainer/test_trainer.py``, ``trainer/test_scheduler.py`` and, with bugs planted,
``test_planted_bugs.py``; every check raises ``AssertionError`` on a violation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from skyrl.train.config import AlgorithmConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore, TenantState
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.scheduler import TrainScheduler
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings


def swap_trainer(micro_model_dir: Path) -> Trainer:
    """One trainer slot; tenants A (rank 8) and B (rank 16) registered."""
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir)
    routing, layers = attach_multi_lora(model, num_slots=1, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=1)
    for index, (name, rank) in enumerate((("A", 8), ("B", 16))):
        weights = init_adapter(layers, rank, 2.0 * rank, torch.Generator().manual_seed(index))
        store.register(name, weights, LRSchedule(base_lr=5e-3), seed=index)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False),
                                                                  OptimizerConfig(), micro_batch_size=3))


def swap_batch(seed: int) -> TrainBatch:
    """Four rows in two GRPO groups with random prompts and responses of 3-6 tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 300, (5,), generator=generator).tolist() for _ in range(4)]
    responses = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (3, 6, 4, 5)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      rewards=[1.0, 0.0, 1.0, 0.0], group_ids=["g0", "g0", "g1", "g1"], rollout_logprobs=None)


def _device_state(store, slot: int, rank: int) -> dict[str, list[torch.Tensor]]:
    """The slot's tables at the tenant's rank (copies), plus the LoRA parameters and their gradients."""
    state = {table: [t.clone() for t in store.table_views(slot, table, rank)] for table in ("master", "exp_avg", "exp_avg_sq")}
    state["grads"] = [t.clone() for t in store.param_views(slot, grads=True, rank=rank)]
    state["params"] = [t.clone() for t in store.param_views(slot, rank=rank)]
    return state


def _host_state(state: TenantState) -> dict[str, list[torch.Tensor]]:
    host = {table: [t.clone() for t in getattr(state, table).values()] for table in ("master", "exp_avg", "exp_avg_sq", "grads")}
    host["params"] = [t.clone() for path in state.weights.a for t in (state.weights.a[path], state.weights.b[path])]
    return host


def _assert_tables_equal(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys()
    for table in want:
        for x, y in zip(got[table], want[table], strict=True):
            assert torch.equal(x, y), f"{where}: {table} differs"


def check_swap_a_b_a(trainer: Trainer) -> None:
    """Swapping A, B, A through one slot: each swap-in puts exactly the tenant's host state on the device
    (weights, masters, both Adam moments, gradients), and each swap-out writes back exactly what the slot
    held after a step (simulated by shifting every table), leaving the other tenant's state untouched."""
    store = trainer.store
    trainer.train_step("A", swap_batch(0))
    trainer.train_step("B", swap_batch(1))  # both tenants have non-zero moments and gradients, at ranks 8 and 16
    host = {name: _host_state(store.tenants[name]) for name in "AB"}
    assert all(t.abs().sum() > 0 for name in "AB" for table in ("exp_avg", "exp_avg_sq", "grads") for t in host[name][table][1::2])
    assert not torch.equal(host["A"]["exp_avg_sq"][1], host["B"]["exp_avg_sq"][1][:, :8])
    for turn, name in enumerate("ABA"):
        state = store.tenants[name]
        other = "B" if name == "A" else "A"
        store.swap_in(name, 0)
        _assert_tables_equal(_device_state(store, 0, state.rank), host[name], f"swap-in {turn} of {name}")
        with torch.no_grad():  # an optimizer step's worth of change in every table
            for index, table in enumerate(("master", "exp_avg", "exp_avg_sq")):
                torch._foreach_add_(store.table_views(0, table, state.rank), 0.25 * (index + 1) + turn)
            torch._foreach_add_(store.param_views(0, grads=True, rank=state.rank), 1.5 + turn)
            torch._foreach_copy_(store.param_views(0), store.table_views(0, "master"))
        expected = _device_state(store, 0, state.rank)
        store.swap_out(0)
        store.wait(name)
        host[name] = _host_state(store.tenants[name])
        _assert_tables_equal(host[name], expected, f"swap-out {turn} of {name}")
        _assert_tables_equal(_host_state(store.tenants[other]), host[other], f"{other} while {name} was swapped")


def scheduler_trainer(model_dir: Path, slots: int, names: str = "ABC") -> Trainer:
    """``slots`` trainer slots; tenants ``names`` (default A, B, C; rank 8, lr 1e-3, 2e-3, 3e-3, ...) registered."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    routing, layers = attach_multi_lora(model, num_slots=slots, max_rank=8, trainable=True)
    store = AdapterStore(layers, num_slots=slots)
    for index, name in enumerate(names):
        store.register(name, init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(index)),
                       LRSchedule(base_lr=1e-3 * (index + 1)), seed=index)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False),
                                                                  OptimizerConfig(), micro_batch_size=4))


def scheduler_batch(seed: int, bad: bool = False, response_len: int = 4) -> TrainBatch:
    """Four rows in two groups, responses of ``response_len`` tokens; ``bad``: the first row's loss mask is one
    short."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 300, (5,), generator=generator).tolist() for _ in range(4)]
    responses = [torch.randint(0, 300, (response_len,), generator=generator).tolist() for _ in range(4)]
    masks = [[1] * (response_len - 1 if bad and i == 0 else response_len) for i in range(4)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=masks, rewards=[1.0, 0.0, 0.0, 1.0],
                      group_ids=["g0", "g0", "g1", "g1"], rollout_logprobs=None)


async def submit_all(scheduler: TrainScheduler, requests: list[tuple[str, TrainBatch]]) -> list:
    return await asyncio.gather(*(scheduler.train(name, batch) for name, batch in requests), return_exceptions=True)


def assert_returned_weights_are_the_stores(trainer: Trainer, names: list[str], results: list) -> None:
    """Each tenant's returned weights are its AdapterStore weights (its masters in the model dtype), and the
    tenants' returned weights differ from each other."""
    trainer.store.wait()
    for name, (weights, _) in zip(names, results, strict=True):
        state = trainer.store.tenants[name]
        for key, master in state.master.items():
            path, part = key.rsplit(".", 1)
            returned = (weights.a if part == "a" else weights.b)[path]
            stored = (state.weights.a if part == "a" else state.weights.b)[path]
            assert torch.equal(returned, stored) and torch.equal(returned, master.to(returned.dtype)), (name, key)
    b_tables = [torch.cat([b.flatten() for b in weights.b.values()]) for weights, _ in results]
    assert all(b.abs().sum() > 0 for b in b_tables)
    assert all(not torch.equal(x, y) for i, x in enumerate(b_tables) for y in b_tables[i + 1:])


def check_scheduler_returns_stored_weights(model_dir: Path, mode: str) -> None:
    """Tenants A, B and C trained through a ``mode`` scheduler get back exactly their stored weights."""
    trainer = scheduler_trainer(model_dir, slots=3)
    scheduler = TrainScheduler(trainer, mode)
    results = asyncio.run(submit_all(scheduler, [("A", scheduler_batch(0)), ("B", scheduler_batch(1)), ("C", scheduler_batch(2))]))
    assert_returned_weights_are_the_stores(trainer, ["A", "B", "C"], results)
