"""AdapterStore swaps and the GRPO trainer (SkyRL's advantage estimator and policy loss)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from skyrl.train.config import AlgorithmConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore, LRSchedule, TenantState
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.trainer import Trainer


def make_trainer(micro_model_dir: Path) -> Trainer:
    """One trainer slot; tenants A (rank 8) and B (rank 16) registered."""
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir)
    routing, layers = attach_multi_lora(model, num_slots=1, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=1)
    for index, (name, rank) in enumerate((("A", 8), ("B", 16))):
        weights = init_adapter(layers, rank, 2.0 * rank, torch.Generator().manual_seed(index))
        store.register(name, weights, LRSchedule(base_lr=5e-3), seed=index)
    return Trainer(model, routing, layers, store, AlgorithmConfig(use_kl_loss=False), OptimizerConfig(), micro_batch_size=3)


@pytest.fixture
def trainer(micro_model_dir: Path) -> Trainer:
    return make_trainer(micro_model_dir)


def _batch(seed: int) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 300, (5,), generator=generator).tolist() for _ in range(4)]
    responses = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (3, 6, 4, 5)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      rewards=[1.0, 0.0, 1.0, 0.0], group_ids=["g0", "g0", "g1", "g1"], rollout_logprobs=None)


def _snapshot(state: TenantState) -> dict:
    tables = {name: {k: v.clone() for k, v in getattr(state, name).items()}
              for name in ("master", "exp_avg", "exp_avg_sq", "grads")}
    tables["weights_a"] = {k: v.clone() for k, v in state.weights.a.items()}
    return {**tables, "rng": state.rng_state.clone(), "step": state.step}


def _assert_same(before: dict, after: dict) -> None:
    assert before["step"] == after["step"]
    assert torch.equal(before["rng"], after["rng"])
    for table in ("master", "exp_avg", "exp_avg_sq", "grads", "weights_a"):
        for key in before[table]:
            assert torch.equal(before[table][key], after[table][key]), f"{table}[{key}] changed"


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


def test_swap_a_b_a_moves_every_table_of_both_tenants(trainer: Trainer) -> None:
    """Swapping A, B, A through one slot: each swap-in puts exactly the tenant's host state on the device
    (weights, masters, both Adam moments, gradients), and each swap-out writes back exactly what the slot
    held after a step (simulated by shifting every table), leaving the other tenant's state untouched."""
    store = trainer.store
    trainer.train_step("A", _batch(0))
    trainer.train_step("B", _batch(1))  # both tenants have non-zero moments and gradients, at ranks 8 and 16
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


def test_training_b_never_changes_a(trainer: Trainer) -> None:
    store = trainer.store
    trainer.train_step("A", _batch(0))
    before = _snapshot(store.tenants["A"])
    b_before = _snapshot(store.tenants["B"])
    for seed in range(3):
        trainer.train_step("B", _batch(seed + 1))
    _assert_same(before, _snapshot(store.tenants["A"]))
    b_after = _snapshot(store.tenants["B"])
    assert b_after["step"] == 3
    assert any(not torch.equal(b_before["master"][k], b_after["master"][k]) for k in b_before["master"])
    # rank-16 slot, rank-8 tenant: the padding beyond A's rank stays zero on the device after its step
    trainer.train_step("A", _batch(5))
    first = next(iter(trainer.layers.values()))
    assert torch.count_nonzero(first.lora_a[0, :8]) > 0
    assert torch.count_nonzero(first.lora_a[0, 8:]) == 0 and torch.count_nonzero(first.lora_b[0, :, 8:]) == 0


def test_grpo_step_raises_the_likelihood_of_rewarded_responses(trainer: Trainer) -> None:
    batch = _batch(7)

    def logprob_sums() -> torch.Tensor:
        lp = trainer.response_logprobs("B", batch)
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (6 - len(r)) for r in batch.response_ids])
        return (lp * mask).sum(dim=1)

    before = logprob_sums()
    for _ in range(5):
        _, metrics = trainer.train_step("B", batch)
    after = logprob_sums()
    assert metrics["grad_norm"] > 0 and metrics["lr"] == 5e-3
    assert after[0] > before[0] and after[2] > before[2], "rewarded responses must become likelier"
    assert after[1] < before[1] and after[3] < before[3], "unrewarded responses must become less likely"


def test_store_rejects_bad_registrations(trainer: Trainer) -> None:
    weights = init_adapter(trainer.layers, 32, 64.0, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="exceeds lora.max_rank"):
        trainer.store.register("C", weights, LRSchedule(base_lr=1e-3), seed=0)
    with pytest.raises(ValueError, match="already registered"):
        trainer.store.register("A", init_adapter(trainer.layers, 8, 16.0, torch.Generator()), LRSchedule(1e-3), seed=0)
    trainer.store.swap_in("A", 0)
    with pytest.raises(RuntimeError, match="still holds"):
        trainer.store.swap_in("B", 0)


def test_lr_schedule() -> None:
    schedule = LRSchedule(base_lr=1.0, warmup_steps=2, total_steps=10, kind="cosine")
    assert schedule.lr(0) == 0.5 and schedule.lr(1) == 1.0
    assert schedule.lr(2) == pytest.approx(1.0) and schedule.lr(10) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        LRSchedule(base_lr=1.0, kind="exotic")
