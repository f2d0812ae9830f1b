"""The trainer's step follows SkyRL's: behaviour log-probs recomputed by the trainer unless the batch brings its own
(the Tinker-style step passes the sampler's), and SkyRL's KL loss against the frozen base (the adapter disabled)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import AdaptiveKLController, compute_approx_kl
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.train.config import AlgorithmConfig, KLCtrlConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.state_io import read_tenant_state, write_tenant_state
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings
from tests.support.transport import swap_batch


def _trainer(model_dir: Path, **algorithm: object) -> Trainer:
    """One slot, tenant B (rank 8, seed 1), micro-batches of 3 rows (so a batch spans two of them)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    routing, layers = attach_multi_lora(model, num_slots=1, max_rank=8, trainable=True)
    store = AdapterStore(layers, num_slots=1)
    store.register("B", init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(1)), LRSchedule(2e-2), seed=1)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(**{"use_kl_loss": False,
                                                                  **algorithm}),
                   OptimizerConfig(), micro_batch_size=3))


def _mask(batch: TrainBatch) -> torch.Tensor:
    width = max(len(r) for r in batch.response_ids)
    return torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in batch.response_ids])


def _rows(table: torch.Tensor, batch: TrainBatch) -> list[list[float]]:
    return [table[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)]


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    state = trainer.store.tenants["B"]
    return [t.clone() for path in state.weights.a for t in (state.weights.a[path], state.weights.b[path])]


def test_kl_is_skyrls_against_the_base_zero_at_step_0_and_positive_after(micro_model_dir: Path) -> None:
    trainer = _trainer(micro_model_dir, use_kl_loss=True, kl_loss_coef=0.1, kl_estimator_type="k3")
    batch = swap_batch(3)
    mask = _mask(batch)
    kls = []
    for _ in range(3):
        # SkyRL's KL term from direct forwards before the step: the tenant's adapter, and the adapter disabled.
        policy, base = trainer.response_logprobs("B", batch), trainer.response_logprobs(None, batch)
        expected = masked_mean(compute_approx_kl(policy, base, loss_mask=mask, kl_estimator_type="k3"), mask, dim=-1).mean()
        _, metrics = trainer.train_step("B", batch)
        assert metrics["policy_kl"] == pytest.approx(expected.item(), rel=1e-4, abs=1e-7)
        kls.append(metrics["policy_kl"])
    assert kls[0] == pytest.approx(0.0, abs=1e-7), "a fresh adapter (B = 0) is the base model: no KL"
    assert kls[1] > 1e-6 and kls[2] > kls[1], "after updates the policy moves away from the base"


def test_kl_loss_changes_the_update_once_the_policy_has_moved(micro_model_dir: Path) -> None:
    plain = _trainer(micro_model_dir)
    with_kl = _trainer(micro_model_dir, use_kl_loss=True, kl_loss_coef=1.0)
    batch = swap_batch(3)
    steps = [(plain.train_step("B", batch)[1], with_kl.train_step("B", batch)[1]) for _ in range(3)]
    # Step 1: policy == base, the KL term and its gradient are zero, so the updates agree.
    assert steps[0][0]["grad_norm"] == pytest.approx(steps[0][1]["grad_norm"], rel=1e-5)
    assert steps[2][1]["policy_kl"] > 0 and "policy_kl" not in steps[2][0]
    assert steps[2][0]["grad_norm"] != pytest.approx(steps[2][1]["grad_norm"], rel=1e-3)
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(_weights(plain), _weights(with_kl)))


def test_batch_log_probs_are_the_ones_the_update_reads(micro_model_dir: Path) -> None:
    """``old_logprobs`` equal to the recomputed ones give the recomputed step; corrupted sampler log-probs as
    ``old_logprobs`` (the Tinker-style step) give another; ``ref_logprobs`` given replace the base forward."""
    batch = swap_batch(5)
    probe = _trainer(micro_model_dir)
    recomputed = _rows(probe.response_logprobs("B", batch), batch)
    base = _rows(probe.response_logprobs(None, batch), batch)
    corrupted = [[lp - 0.7 for lp in row] for row in recomputed]
    assert max(abs(a - b) for ra, rb in zip(recomputed, corrupted) for a, b in zip(ra, rb)) > 0.5

    def step(trainer: Trainer, **fields: object) -> tuple[dict[str, float], list[torch.Tensor]]:
        trainer.train_step("B", dataclasses.replace(batch, **fields))  # moves the policy off the base
        metrics = trainer.train_step("B", dataclasses.replace(batch, **fields))[1]
        return metrics, _weights(trainer)

    own, own_weights = step(_trainer(micro_model_dir))
    same, same_weights = step(_trainer(micro_model_dir), old_logprobs=None)
    assert own["grad_norm"] == same["grad_norm"]
    first = _trainer(micro_model_dir)
    first.train_step("B", batch)
    again = _rows(first.response_logprobs("B", batch), batch)
    given = first.train_step("B", dataclasses.replace(batch, old_logprobs=again))[1]
    assert given["grad_norm"] == pytest.approx(own["grad_norm"], rel=1e-4)
    stale, _ = step(_trainer(micro_model_dir), old_logprobs=corrupted)
    assert stale["grad_norm"] != pytest.approx(own["grad_norm"], rel=1e-2), "the ratio must read the given log-probs"

    kl_own, _ = step(_trainer(micro_model_dir, use_kl_loss=True, kl_loss_coef=1.0))
    kl_given, _ = step(_trainer(micro_model_dir, use_kl_loss=True, kl_loss_coef=1.0), ref_logprobs=base)
    kl_wrong, _ = step(_trainer(micro_model_dir, use_kl_loss=True, kl_loss_coef=1.0), ref_logprobs=corrupted)
    assert kl_given["policy_kl"] == pytest.approx(kl_own["policy_kl"], rel=1e-4) and kl_own["policy_kl"] > 0
    assert kl_wrong["policy_kl"] != pytest.approx(kl_own["policy_kl"], rel=0.1), "the KL must read the given ref"


def test_kl_in_reward_is_skyrls_penalty_on_the_rewards(micro_model_dir: Path) -> None:
    """With ``use_kl_in_reward`` a step trains on the rewards less SkyRL's penalty (per token ``kl * kl_loss_coef``,
    summed into each row's reward by GRPO): the same step as a plain trainer given those rewards."""
    coef = 5.0
    penalised = _trainer(micro_model_dir, use_kl_in_reward=True, kl_loss_coef=coef, kl_estimator_type="k1")
    plain, unpenalised = _trainer(micro_model_dir), _trainer(micro_model_dir)
    batch = swap_batch(3)
    first = [t.train_step("B", batch)[1] for t in (penalised, plain, unpenalised)]
    assert first[0]["avg_kl"] == pytest.approx(0.0, abs=1e-7), "a fresh adapter is the base: no penalty"
    assert first[0]["grad_norm"] == pytest.approx(first[1]["grad_norm"], rel=1e-5)

    # Step 2 on equal rewards: without the penalty every GRPO advantage is zero; with it, the rows differ by KL.
    flat = dataclasses.replace(batch, rewards=[1.0] * len(batch.rewards))
    mask = _mask(flat)
    policy, base = penalised.response_logprobs("B", flat), penalised.response_logprobs(None, flat)
    kl = compute_approx_kl(policy, base, loss_mask=mask, kl_estimator_type="k1")
    rewards = [r - coef * kl[i].sum().item() for i, r in enumerate(flat.rewards)]
    stepped = penalised.train_step("B", flat)[1]
    expected = plain.train_step("B", dataclasses.replace(flat, rewards=rewards))[1]
    without = unpenalised.train_step("B", flat)[1]
    assert stepped["avg_kl"] == pytest.approx(masked_mean(kl, mask, dim=-1).mean().item(), rel=1e-4)
    assert stepped["avg_kl"] != 0.0
    assert stepped["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    assert without["grad_norm"] == 0.0 < stepped["grad_norm"]


def test_adaptive_kl_controller_moves_as_skyrls_and_survives_a_resume(micro_model_dir: Path, tmp_path: Path) -> None:
    """``kl_ctrl.type=adaptive``: each step's penalty coefficient is SkyRL's ``AdaptiveKLController``'s value, updated
    after the step with the step's ``avg_kl`` and row count; the value is in the tenant's checkpoint, so a resumed
    tenant continues with it; another tenant's controller is its own."""
    settings = dict(use_kl_in_reward=True, kl_loss_coef=0.5, kl_estimator_type="k3",
                    kl_ctrl=KLCtrlConfig(type="adaptive", kl_target=1e-5, horizon=8))
    trainer = _trainer(micro_model_dir, **settings)
    trainer.store.register("C", init_adapter(trainer.layers, 8, 16.0, torch.Generator().manual_seed(2)), LRSchedule(2e-2),
                           seed=2)
    batch = swap_batch(3)
    reference = AdaptiveKLController(init_kl_coef=0.5, target=1e-5, horizon=8)
    values = []
    for _ in range(3):
        _, metrics = trainer.train_step("B", batch)
        assert metrics["kl_loss_coef"] == reference.value  # the coefficient this step applied
        reference.update(current=metrics["avg_kl"], n_steps=len(batch.rewards))
        assert trainer.store.tenants["B"].kl_coef == reference.value
        values.append(reference.value)
    assert values[0] < 0.5 < values[2], "no KL at step 1 lowers the coefficient, KL above the target raises it"
    assert trainer.store.tenants["C"].kl_coef is None  # C's controller has not started

    write_tenant_state(trainer.store, "B", tmp_path)
    resumed = _trainer(micro_model_dir, **settings)
    read_tenant_state(resumed.store, "B", tmp_path)
    assert resumed.store.tenants["B"].kl_coef == values[-1]
    got, want = resumed.train_step("B", batch)[1], trainer.train_step("B", batch)[1]
    assert got["kl_loss_coef"] == want["kl_loss_coef"] == values[-1]
    assert resumed.store.tenants["B"].kl_coef == trainer.store.tenants["B"].kl_coef
    assert all(torch.equal(a, b) for a, b in zip(_weights(resumed), _weights(trainer)))


def test_fixed_kl_controller_keeps_kl_loss_coef(micro_model_dir: Path) -> None:
    trainer = _trainer(micro_model_dir, use_kl_in_reward=True, kl_loss_coef=0.5)
    batch = swap_batch(3)
    coefs = [trainer.train_step("B", batch)[1]["kl_loss_coef"] for _ in range(2)]
    assert coefs == [0.5, 0.5] and trainer.store.tenants["B"].kl_coef == 0.5
