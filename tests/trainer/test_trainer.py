"""The GRPO trainer (:mod:`skyrl_clora.trainer.trainer`) in swap mode: a step with SkyRL's advantage estimator and
policy loss raises the likelihood of rewarded responses, and training one tenant never changes another's state."""

from __future__ import annotations

import torch

from skyrl_clora.trainer.adapter_store import TenantState
from skyrl_clora.trainer.trainer import Trainer
from tests.support.swap_trainer_fixture import trainer  # noqa: F401 - the fixture the tests take
from tests.support.transport import swap_batch


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


def test_training_b_never_changes_a(trainer: Trainer) -> None:
    store = trainer.store
    trainer.train_step("A", swap_batch(0))
    before = _snapshot(store.tenants["A"])
    b_before = _snapshot(store.tenants["B"])
    for seed in range(3):
        trainer.train_step("B", swap_batch(seed + 1))
    _assert_same(before, _snapshot(store.tenants["A"]))
    b_after = _snapshot(store.tenants["B"])
    assert b_after["step"] == 3
    assert any(not torch.equal(b_before["master"][k], b_after["master"][k]) for k in b_before["master"])
    # rank-16 slot, rank-8 tenant: the padding beyond A's rank stays zero on the device after its step
    trainer.train_step("A", swap_batch(5))
    first = next(iter(trainer.layers.values()))
    assert torch.count_nonzero(first.lora_a[0, :8]) > 0
    assert torch.count_nonzero(first.lora_a[0, 8:]) == 0 and torch.count_nonzero(first.lora_b[0, :, 8:]) == 0


def test_grpo_step_raises_the_likelihood_of_rewarded_responses(trainer: Trainer) -> None:
    batch = swap_batch(7)

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
