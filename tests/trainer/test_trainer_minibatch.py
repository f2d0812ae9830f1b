"""SkyRL's mini-batches in the embedded trainer (:mod:`skyrl_clora.trainer.trainer`):
``trainer.policy_mini_batch_size`` prompts per optimizer step and ``trainer.update_epochs_per_batch`` passes, each
step with its own loss normaliser, LR-schedule step and the batch's pre-update log-probs as the behaviour policy; the
tenants of a packed pass stay independent, each with its own algorithm settings and weight decay when it overrides
them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from skyrl.train.config import AlgorithmConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch, mini_batch_rows
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.state_io import read_tenant_state, write_tenant_state
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings

# name, rank, alpha, lr, seed
TENANTS = (("A", 8, 16.0, 2e-2, 0), ("B", 16, 16.0, 1e-2, 1))


# fp32 master weights of runs that take other GEMM shapes (packed vs alone, mini-batches vs by hand) agree to rounding,
# except where Adam divides a near-zero gradient by the root of its near-zero second moment: there a rounding
# difference of the gradient becomes an update difference of a few 1e-6 (2.8e-6 seen on an AMD EPYC CPU). The
# checks that the compared runs differ from the contrasting ones use 1e-5; an update is ~lr (1e-2).
MASTER_ATOL = 1e-5

def _trainer(model_dir: Path, slots: int = 1, mini_batch_prompts: int = 0, update_epochs: int = 1,
             total_steps: int = 4) -> Trainer:
    """Tenants A and B with a cosine schedule over ``total_steps`` optimizer steps (the LR differs at each)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    routing, layers = attach_multi_lora(model, num_slots=slots, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=slots)
    for name, rank, alpha, lr, seed in TENANTS:
        weights = init_adapter(layers, rank, alpha, torch.Generator().manual_seed(seed))
        store.register(name, weights, LRSchedule(lr, total_steps=total_steps, kind="cosine"), seed=seed)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False), OptimizerConfig(),
                   micro_batch_size=3, mini_batch_prompts=mini_batch_prompts, update_epochs=update_epochs))


def _batch(seed: int, prompts: int = 4, samples: int = 2) -> TrainBatch:
    """``prompts`` GRPO groups of ``samples`` rows (a group's rows share its prompt), mixed rewards in each group."""
    generator = torch.Generator().manual_seed(seed)
    rows = prompts * samples
    prompt_ids = [torch.randint(0, 300, (int(torch.randint(3, 7, (1,), generator=generator)),), generator=generator)
                  .tolist() for _ in range(prompts)]
    responses = [torch.randint(0, 300, (int(torch.randint(2, 8, (1,), generator=generator)),), generator=generator)
                 .tolist() for _ in range(rows)]
    return TrainBatch(prompt_ids=[prompt_ids[i // samples] for i in range(rows)], response_ids=responses,
                      loss_masks=[[1] * len(r) for r in responses], rewards=[float(i % 2 == 0) for i in range(rows)],
                      group_ids=[f"g{i // samples}" for i in range(rows)], rollout_logprobs=None)


def _rows(batch: TrainBatch, rows: list[int], old: list[list[float]] | None = None) -> TrainBatch:
    """``batch``'s ``rows``, with ``old`` as their behaviour log-probs when given."""
    pick = {name: [getattr(batch, name)[i] for i in rows]
            for name in ("prompt_ids", "response_ids", "loss_masks", "rewards", "group_ids")}
    return TrainBatch(**pick, rollout_logprobs=None, old_logprobs=old)


def _logprob_rows(trainer: Trainer, tenant: str, batch: TrainBatch) -> list[list[float]]:
    table = trainer.response_logprobs(tenant, batch)
    return [table[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)]


def _masters(trainer: Trainer, tenant: str) -> list[torch.Tensor]:
    return [t.clone() for t in trainer.store.tenants[tenant].flat.values()]


@pytest.mark.parametrize("epochs", [1, 2])
def test_half_batch_mini_batches_equal_sequential_steps_on_the_halves(micro_model_dir: Path, epochs: int) -> None:
    batch = _batch(seed=3)
    halves = mini_batch_rows(batch.group_ids, 2)
    mini = _trainer(micro_model_dir, mini_batch_prompts=2, update_epochs=epochs)
    by_hand = _trainer(micro_model_dir)
    whole = _trainer(micro_model_dir)

    _, metrics = mini.train_step("A", batch)

    # SkyRL's order: the pre-update policy's log-probs of every row first, then one step per half, per epoch.
    old = _logprob_rows(by_hand, "A", batch)
    steps = [by_hand.train_step("A", _rows(batch, half, [old[i] for i in half]))[1]
             for _ in range(epochs) for half in halves]
    lrs = [step["lr"] for step in steps]
    whole.train_step("A", batch)

    assert mini.store.tenants["A"].step == by_hand.store.tenants["A"].step == 2 * epochs
    assert metrics["optimizer_steps"] == 2 * epochs
    assert metrics["lr"] == pytest.approx(sum(lrs) / len(lrs)) and len(set(lrs)) == len(lrs)
    # SkyRL's reduction over the step's mini-batches (the mean), each mini-batch its own loss normaliser
    assert metrics["policy_loss"] == pytest.approx(sum(s["policy_loss"] for s in steps) / len(steps), rel=1e-4)
    assert torch.equal(mini.store.tenants["A"].rng_state, by_hand.store.tenants["A"].rng_state)
    for got, want in zip(_masters(mini, "A"), _masters(by_hand, "A")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=MASTER_ATOL)
    # ... and mini-batching changed the update (the comparison above is not vacuous)
    assert any(not torch.allclose(a, b, atol=1e-5) for a, b in zip(_masters(mini, "A"), _masters(whole, "A")))
    # tenant B, never trained, kept its initial state
    assert all(torch.equal(a, b) for a, b in zip(_masters(mini, "B"), _masters(whole, "B")))


def test_packed_mini_batch_steps_equal_each_tenant_alone(micro_model_dir: Path) -> None:
    batches = {"A": _batch(seed=5), "B": _batch(seed=6)}
    packed = _trainer(micro_model_dir, slots=2, mini_batch_prompts=2)
    alone = _trainer(micro_model_dir, mini_batch_prompts=2)
    together = dict(zip(batches, (m for _, m in packed.train_packed(list(batches.items())))))
    for name, batch in batches.items():
        metrics = alone.train_step(name, batch)[1]
        assert together[name]["optimizer_steps"] == metrics["optimizer_steps"] == 2
        assert together[name]["policy_loss"] == pytest.approx(metrics["policy_loss"], rel=1e-4, abs=1e-6)
        for got, want in zip(_masters(packed, name), _masters(alone, name)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=MASTER_ATOL)
        assert packed.store.tenants[name].step == 2
    assert together["A"]["policy_loss"] != pytest.approx(together["B"]["policy_loss"], rel=1e-3)


def test_a_tenant_resumed_between_mini_batch_steps_continues_bit_for_bit(micro_model_dir: Path, tmp_path: Path) -> None:
    """The tenant's saved state (masters, moments, optimizer step, RNG) is all a mini-batch run continues from."""
    first, second = _batch(seed=7), _batch(seed=8)
    straight = _trainer(micro_model_dir, mini_batch_prompts=1, total_steps=16)
    straight.train_step("A", first)
    write_tenant_state(straight.store, "A", tmp_path)
    resumed = _trainer(micro_model_dir, mini_batch_prompts=1, total_steps=16)
    read_tenant_state(resumed.store, "A", tmp_path)
    assert resumed.store.tenants["A"].step == 4  # four one-prompt mini-batches
    before = _masters(straight, "A")
    got, want = resumed.train_step("A", second)[1], straight.train_step("A", second)[1]
    assert got == want and resumed.store.tenants["A"].step == 8 and want["lr"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, _masters(straight, "A")))  # the second step trained
    assert all(torch.equal(a, b) for a, b in zip(_masters(resumed, "A"), _masters(straight, "A")))
    assert torch.equal(resumed.store.tenants["A"].rng_state, straight.store.tenants["A"].rng_state)


def _single(model_dir: Path, algorithm: AlgorithmConfig, optimizer: OptimizerConfig, slots: int = 1,
            tenant_algorithm: AlgorithmConfig | None = None, tenant_weight_decay: float | None = None,
            tenant_max_grad_norm: float | None = None) -> Trainer:
    """Tenant A (and B) under run-wide ``algorithm`` and ``optimizer``; A's own overrides when given."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    routing, layers = attach_multi_lora(model, num_slots=slots, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=slots)
    for name, rank, alpha, lr, seed in TENANTS:
        own = name == "A"
        store.register(name, init_adapter(layers, rank, alpha, torch.Generator().manual_seed(seed)), LRSchedule(lr),
                       seed=seed, algorithm=tenant_algorithm if own else None,
                       weight_decay=tenant_weight_decay if own else None,
                       max_grad_norm=tenant_max_grad_norm if own else None)
    return Trainer(model, routing, layers, store, TrainerSettings(algorithm, optimizer, micro_batch_size=3))


@pytest.mark.parametrize("policy_loss_type", ["regular", "gspo"])
def test_a_tenants_own_algorithm_and_optimizer_settings_are_its_alone(micro_model_dir: Path,
                                                                      policy_loss_type: str) -> None:
    """Tenant A's overrides (RLOO advantages, a tighter clip, its policy loss, weight decay, gradient clipping) in a
    packed pass with B (the run's GRPO, regular loss): A trains as in a run whose settings are A's, B as in the
    run's."""
    run = AlgorithmConfig(use_kl_loss=False)
    own = AlgorithmConfig(use_kl_loss=False, advantage_estimator="rloo", eps_clip_high=0.05,
                          policy_loss_type=policy_loss_type)
    batches = {"A": _batch(seed=11), "B": _batch(seed=12)}
    packed = _single(micro_model_dir, run, OptimizerConfig(), slots=2, tenant_algorithm=own, tenant_weight_decay=0.5,
                     tenant_max_grad_norm=0.5)
    results = dict(zip(batches, (m for _, m in packed.train_packed(list(batches.items())))))
    for _ in range(2):  # a second step: the ratio leaves 1, so the clip acts
        results = dict(zip(batches, (m for _, m in packed.train_packed(list(batches.items())))))
    as_a = _single(micro_model_dir, own, OptimizerConfig(weight_decay=0.5, max_grad_norm=0.5))
    as_run = _single(micro_model_dir, run, OptimizerConfig())
    for _ in range(3):
        a_alone, b_alone = as_a.train_step("A", batches["A"])[1], as_run.train_step("B", batches["B"])[1]
        plain_a = as_run.train_step("A", batches["A"])[1]
    assert results["A"]["grad_norm"] > 0.5, "A's clipping acts"
    assert results["A"]["policy_loss"] == pytest.approx(a_alone["policy_loss"], rel=1e-4, abs=1e-6)
    assert results["B"]["policy_loss"] == pytest.approx(b_alone["policy_loss"], rel=1e-4, abs=1e-6)
    for name, alone in (("A", as_a), ("B", as_run)):
        for got, want in zip(_masters(packed, name), _masters(alone, name)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=MASTER_ATOL)
    # ... and A's overrides changed its training (the comparison above is not vacuous)
    assert plain_a["policy_loss"] != pytest.approx(a_alone["policy_loss"], rel=1e-3)
    assert any(not torch.allclose(a, b, atol=1e-5) for a, b in zip(_masters(as_a, "A"), _masters(as_run, "A")))
