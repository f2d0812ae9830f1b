"""The trainer (:mod:`skyrl_clora.trainer.trainer`) in packed mode: a packed pass trains each tenant as swap mode
trains it alone (metrics and states), slots are zero-padded and scaled per tenant, prefetching swaps give the same
states, bad requests change nobody, response log-probs are the full logits', and shared prompts and token-budget
micro-batches train as whole-sequence row micro-batches."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from skyrl.train.config import AlgorithmConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings

# name, rank, alpha, lr, seed: different lr, rank and seed per tenant
TENANTS = (("A", 8, 16.0, 5e-3, 0), ("B", 16, 16.0, 2e-3, 1), ("C", 4, 12.0, 8e-3, 2))


def _trainer(model_dir: Path, slots: int, micro_batch_size: int = 3) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    routing, layers = attach_multi_lora(model, num_slots=slots, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=slots)
    for name, rank, alpha, lr, seed in TENANTS:
        weights = init_adapter(layers, rank, alpha, torch.Generator().manual_seed(seed))
        store.register(name, weights, LRSchedule(base_lr=lr, warmup_steps=0, total_steps=4, kind="cosine"), seed=seed)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False), OptimizerConfig(),
                   micro_batch_size=micro_batch_size))


def _batch(seed: int, rows: int = 4, logprobs: bool = False) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 300, (int(torch.randint(3, 8, (1,), generator=generator)),), generator=generator).tolist()
               for _ in range(rows)]
    responses = [torch.randint(0, 300, (int(torch.randint(2, 9, (1,), generator=generator)),), generator=generator).tolist()
                 for _ in range(rows)]
    masks = [[int(j % 4 != 3) for j in range(len(r))] for r in responses]
    rewards = [float(torch.rand(1, generator=generator) > 0.5) for _ in range(rows)]
    sampler = [(-torch.rand(len(r), generator=generator) * 5).tolist() for r in responses] if logprobs else None
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=masks, rewards=rewards,
                      group_ids=[f"g{i // 2}" for i in range(rows)], rollout_logprobs=sampler)


def _batches(step: int) -> dict[str, TrainBatch]:
    return {"A": _batch(10 * step, rows=4, logprobs=True), "B": _batch(10 * step + 1, rows=5),
            "C": _batch(10 * step + 2, rows=3, logprobs=True)}


def test_packed_training_equals_each_tenant_trained_alone(micro_model_dir: Path) -> None:
    swap, packed = _trainer(micro_model_dir, slots=1), _trainer(micro_model_dir, slots=3)
    for step in range(2):
        batches = _batches(step)
        alone = {name: swap.train_step(name, batch)[1] for name, batch in batches.items()}
        together = dict(zip(batches, (m for _, m in packed.train_packed(list(batches.items())))))
        # the tenants' updates differ from each other (the comparison below is not vacuous) ...
        assert len({round(m["mean_token_logprob"], 6) for m in alone.values()}) == 3
        assert len({m["lr"] for m in alone.values()}) == 3
        for name in batches:  # ... and each equals the tenant trained alone, metric by metric
            assert alone[name].keys() == together[name].keys()
            for key, value in alone[name].items():
                assert together[name][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
    masters = {}
    for name, *_ in TENANTS:
        a, b = swap.store.tenants[name], packed.store.tenants[name]
        assert a.step == b.step == 2 and torch.equal(a.rng_state, b.rng_state)
        for table in ("master", "exp_avg", "exp_avg_sq", "grads"):
            for key in a.master:
                torch.testing.assert_close(getattr(b, table)[key], getattr(a, table)[key], rtol=1e-4, atol=1e-7)
        for key in a.weights.a:
            torch.testing.assert_close(b.weights.a[key], a.weights.a[key], rtol=1e-4, atol=1e-7)
        masters[name] = torch.cat([v.flatten() for k, v in a.master.items() if k.endswith(".b")])
    assert all(masters[x].abs().sum() > 0 for x in masters)
    assert not torch.allclose(masters["A"][: masters["C"].numel()], masters["C"][: masters["A"].numel()])


def test_every_pack_the_ready_policy_can_form_trains_each_tenant_as_alone(micro_model_dir: Path) -> None:
    """``clora.pack_policy=ready`` packs whichever tenants wait, in the order they came, which depends on timing:
    every such pack (each set of two or three tenants, in every order) trains each of its tenants as it trains
    alone. Gradients and moments agree to rounding; weights within 2% of the tenant's lr, since AdamW moves every
    weight by about lr a step whatever its gradient's size, so a gradient near Adam's eps turns rounding into a
    share of lr (``isolation.assert_same_tenants``); another tenant's rows in the pass would move them by ~lr."""
    lrs = {name: lr for name, _, _, lr, _ in TENANTS}
    batches = _batches(0)
    swap = _trainer(micro_model_dir, slots=1)
    alone = {name: swap.train_step(name, batch)[1] for name, batch in batches.items()}
    grads = [swap.store.tenants[name].flat["grads"] for name in batches]
    assert not any(torch.equal(x[: y.numel()], y[: x.numel()]) for x, y in itertools.combinations(grads, 2))
    for size in (2, 3):
        for pack in itertools.permutations(batches, size):
            packed = _trainer(micro_model_dir, slots=3)
            results = packed.train_packed([(name, batches[name]) for name in pack])
            for name, (_, metrics) in zip(pack, results):
                for key, value in alone[name].items():
                    assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (pack, name, key)
                a, b = swap.store.tenants[name].flat, packed.store.tenants[name].flat
                for table in ("grads", "exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(b[table], a[table], rtol=1e-4, atol=1e-4 * float(a[table].abs().max()),
                                               msg=lambda m: f"{pack} {name} {table}: {m}")
                torch.testing.assert_close(b["master"], a["master"], rtol=0.0, atol=0.02 * lrs[name],
                                           msg=lambda m: f"{pack} {name} master: {m}")


def test_packed_slots_are_zero_padded_and_scaled_per_tenant(micro_model_dir: Path) -> None:
    trainer = _trainer(micro_model_dir, slots=3)
    trainer.train_packed(list(_batches(0).items()))
    trainer.train_packed(list(_batches(1).items()))
    # swap the rank-4 tenant into slot 2 and check the padding on the device
    trainer.store.swap_in("C", 2)
    layer = next(iter(trainer.layers.values()))
    assert torch.count_nonzero(layer.lora_b[2, :, :4]) > 0
    assert torch.count_nonzero(layer.lora_a[2, 4:]) == 0 and torch.count_nonzero(layer.lora_b[2, :, 4:]) == 0
    assert layer.scales[2] == 3.0
    trainer.store.swap_out(2)
    assert layer.scales[2] == 0.0


def test_prefetching_swaps_give_the_same_states(micro_model_dir: Path) -> None:
    plain, prefetching = _trainer(micro_model_dir, slots=1), _trainer(micro_model_dir, slots=2)
    schedule = [("A", "B"), ("B", "C"), ("C", "A"), ("A", "C"), ("B", None), ("C", "C")]  # 4th prefetch is wrong
    used_slots = []
    for index, (name, upcoming) in enumerate(schedule):
        batch = _batch(100 + index, rows=4, logprobs=index % 2 == 0)
        expected = plain.train_step(name, batch)
        used_slots.append(prefetching.store.slot_of(name))
        got = prefetching.train_step(name, batch, prefetch=upcoming)
        assert got[1] == expected[1]
        if upcoming not in (None, name):
            assert prefetching.store.slot_of(upcoming) is not None
    assert used_slots[1:4] == [1, 0, 1]  # the prefetched tenant was trained in the slot it was copied into
    for name, *_ in TENANTS:
        a, b = plain.store.tenants[name], prefetching.store.tenants[name]
        assert a.step == b.step
        for table in ("master", "exp_avg", "exp_avg_sq", "grads"):
            assert torch.equal(a.flat[table], b.flat[table]), (name, table)
    with pytest.raises(RuntimeError, match="already on the device"):
        prefetching.store.prefetch("A", 1)
        prefetching.store.prefetch("A", 0)


def test_train_packed_rejects_bad_requests(micro_model_dir: Path) -> None:
    trainer = _trainer(micro_model_dir, slots=2)
    with pytest.raises(ValueError, match="exceed the trainer's 2 slots"):
        trainer.train_packed(list(_batches(0).items()))
    with pytest.raises(ValueError, match="distinct tenants"):
        trainer.train_packed([("A", _batch(0)), ("A", _batch(1))])
    bad = _batch(0)
    bad.loss_masks[1] = bad.loss_masks[1][:-1]
    with pytest.raises(ValueError, match="row 1: loss mask of length"):
        trainer.train_packed([("A", _batch(0)), ("B", bad)])
    assert all(slot.owner is None for slot in trainer.store.slots)
    assert trainer.store.tenants["A"].step == 0  # the failed pass changed nobody


def test_response_logprobs_match_full_logits(micro_model_dir: Path) -> None:
    trainer = _trainer(micro_model_dir, slots=1, micro_batch_size=2)
    batch = _batch(3, rows=5)
    trainer.train_step("B", batch)  # a non-zero adapter
    got = trainer.response_logprobs("B", batch)
    trainer.store.swap_in("B", 0)
    try:
        with torch.no_grad():
            for row, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
                ids = torch.tensor([prompt + response])
                with trainer.routing.route(torch.zeros(ids.numel(), dtype=torch.long)):
                    logits = trainer.model(input_ids=ids).logits.float()
                full = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
                torch.testing.assert_close(got[row, : len(response)], full[len(prompt) - 1 :], rtol=1e-5, atol=1e-5)
    finally:
        trainer.store.swap_out(0)


def _grouped_batch(seed: int, groups: int = 3, samples: int = 3) -> TrainBatch:
    """GRPO-shaped: ``groups`` prompts of different lengths, each sampled ``samples`` times."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 300, (4 + 3 * g,), generator=generator).tolist() for g in range(groups)]
    responses = [torch.randint(0, 300, (int(torch.randint(2, 9, (1,), generator=generator)),), generator=generator).tolist()
                 for _ in range(groups * samples)]
    return TrainBatch(
        prompt_ids=[prompts[i // samples] for i in range(groups * samples)], response_ids=responses,
        loss_masks=[[int(j % 4 != 3) for j in range(len(r))] for r in responses],
        rewards=[float(torch.rand(1, generator=generator) > 0.5) for _ in responses],
        group_ids=[f"g{i // samples}" for i in range(groups * samples)], rollout_logprobs=None,
    )


def test_shared_prompts_train_as_if_every_row_ran_its_whole_sequence(micro_model_dir: Path) -> None:
    """Packed A and B with the same prompts (another tenant's adapter changes them: not shared across
    tenants) and micro-batches that cut groups: computing each prompt once changes nothing."""
    shared, full = _trainer(micro_model_dir, slots=2, micro_batch_size=4), _trainer(micro_model_dir, slots=2, micro_batch_size=4)
    shared.shared_prefix = True
    calls, full_calls = [], []
    original, full_original = shared.decoder.forward, full.decoder.forward
    shared.decoder.forward = lambda *args, **kwargs: calls.append(kwargs["input_ids"].shape) or original(*args, **kwargs)
    full.decoder.forward = lambda *args, **kwargs: full_calls.append(kwargs["input_ids"].shape) or full_original(*args, **kwargs)
    for step in range(2):
        items = [("A", _grouped_batch(step)), ("B", _grouped_batch(step))]
        got = dict(zip(("A", "B"), (m for _, m in shared.train_packed(items))))
        want = dict(zip(("A", "B"), (m for _, m in full.train_packed(items))))
        if step:  # once trained (LoRA B starts at zero), the tenants' adapters give different log-probs
            assert got["A"]["mean_token_logprob"] != pytest.approx(got["B"]["mean_token_logprob"], rel=1e-4)
        for name in ("A", "B"):
            for key, value in want[name].items():
                assert got[name][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
    assert any(shape[0] < 4 for shape in calls[::2]), "prompt passes run fewer rows than the micro-batch"
    assert len(full_calls) == 2 * 5, "without shared prompts: one whole-sequence pass per micro-batch (18 rows in 4s)"
    for name in ("A", "B"):
        a, b = full.store.tenants[name], shared.store.tenants[name]
        assert torch.equal(a.rng_state, b.rng_state)
        for table in ("master", "exp_avg", "exp_avg_sq", "grads"):
            for key in a.master:
                # summing a shared prompt's gradients over its rows reorders float additions
                torch.testing.assert_close(getattr(b, table)[key], getattr(a, table)[key], rtol=1e-4, atol=1e-6)
    batch = _grouped_batch(5)
    torch.testing.assert_close(shared.response_logprobs("A", batch), full.response_logprobs("A", batch), rtol=1e-5, atol=1e-5)


def test_token_budget_micro_batches_train_as_row_micro_batches(micro_model_dir: Path) -> None:
    """Packed A and B with shared prompts, micro-batches of 2 rows against micro-batches of up to 60 computed
    positions (several groups each): fewer decoder passes, the same metrics and tenant states."""
    rows_trainer, tokens_trainer = _trainer(micro_model_dir, slots=2, micro_batch_size=2), _trainer(micro_model_dir, slots=2)
    tokens_trainer.max_tokens_per_microbatch = 60
    calls: dict[str, int] = {"rows": 0, "tokens": 0}
    for label, trainer in (("rows", rows_trainer), ("tokens", tokens_trainer)):
        trainer.shared_prefix = True
        forward = trainer.decoder.forward
        trainer.decoder.forward = lambda *args, _f=forward, _l=label, **kwargs: calls.__setitem__(_l, calls[_l] + 1) or _f(
            *args, **kwargs)
    for step in range(2):
        items = [("A", _grouped_batch(step)), ("B", _grouped_batch(step + 7))]
        want = dict(zip(("A", "B"), (m for _, m in rows_trainer.train_packed(items))))
        got = dict(zip(("A", "B"), (m for _, m in tokens_trainer.train_packed(items))))
        for name in ("A", "B"):
            for key, value in want[name].items():
                assert got[name][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
    assert 0 < 2 * calls["tokens"] < calls["rows"]
    for name in ("A", "B"):
        a, b = rows_trainer.store.tenants[name], tokens_trainer.store.tenants[name]
        for table in ("master", "exp_avg", "exp_avg_sq", "grads"):
            for key in a.master:
                torch.testing.assert_close(getattr(b, table)[key], getattr(a, table)[key], rtol=1e-4, atol=1e-6)
