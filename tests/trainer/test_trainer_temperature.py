"""The trainer (:mod:`skyrl_clora.trainer.trainer`) scores at the sampling temperature, as SkyRL's policy forward
computes it (``logits / T``), and agrees with the sampler's log-probs of the same tokens (the distribution it drew
them from); the reference stays untempered, and packed tenants each score at their own temperature."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from skyrl.train.config import AlgorithmConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.sampling import request_uniforms, sample_rows
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings

PROMPT = list(range(5, 17))


def _trainer(model_dir: Path, temperature: float, slots: int = 1, shared_prefix: bool = False) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    routing, layers = attach_multi_lora(model, num_slots=slots, max_rank=8, trainable=True)
    store = AdapterStore(layers, num_slots=slots)
    for seed, name in enumerate(("A", "B")):
        store.register(name, init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(seed)), LRSchedule(5e-2),
                       seed=seed)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False,
                                                                  temperature=temperature),
                   OptimizerConfig(), micro_batch_size=4, shared_prefix=shared_prefix))


def _batch(responses: list[list[int]]) -> TrainBatch:
    """Two GRPO groups over one prompt (rows share it: the shared-prompt path computes it once)."""
    rows = len(responses)
    return TrainBatch(prompt_ids=[PROMPT] * rows, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      rewards=[float(i % 2) for i in range(rows)], group_ids=["g"] * rows, rollout_logprobs=None)


def _reference(trainer: Trainer, tenant: str | None, batch: TrainBatch, temperature: float) -> list[torch.Tensor]:
    """Per row, ``log_softmax(logits / T)`` of its response tokens from the model's full logits (pure torch)."""
    if tenant is not None:
        trainer.store.swap_in(tenant, 0)
    try:
        out = []
        with torch.no_grad():
            for prompt, response in zip(batch.prompt_ids, batch.response_ids):
                ids = torch.tensor([prompt + response])
                with trainer.routing.route(torch.zeros(ids.numel(), dtype=torch.long) if tenant else None):
                    logits = trainer.model(input_ids=ids).logits[0, :-1].float()
                full = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
                out.append(full[len(prompt) - 1 :])
        return out
    finally:
        if tenant is not None:
            trainer.store.swap_out(0)


def _sampled(trainer: Trainer, temperature: float, seed: int, length: int = 6) -> tuple[list[int], list[float]]:
    """``length`` tokens after :data:`PROMPT` drawn by the sampler's own function at ``temperature`` from the base
    model's logits, with the log-probs it reports."""
    ids, logprobs = list(PROMPT), []
    with torch.no_grad(), trainer.routing.route(None):
        for index in range(length):
            logits = trainer.model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
            tokens, values = sample_rows(logits, [temperature], [1.0], request_uniforms([seed], [index]))
            ids.append(tokens[0])
            logprobs.append(values[0])
    return ids[len(PROMPT):], logprobs


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_policy_log_probs_are_of_the_logits_over_the_temperature(micro_model_dir: Path, shared_prefix: bool) -> None:
    trainer = _trainer(micro_model_dir, temperature=0.5, shared_prefix=shared_prefix)
    batch = _batch([[30, 31, 32, 2], [40, 41, 2], [50, 51, 52, 53, 2]])
    trainer.train_step("A", batch)  # a non-zero adapter
    got = trainer.response_logprobs("A", batch)
    tempered, plain = _reference(trainer, "A", batch, 0.5), _reference(trainer, "A", batch, 1.0)
    for row, (want, untempered) in enumerate(zip(tempered, plain)):
        torch.testing.assert_close(got[row, : len(want)], want, rtol=1e-5, atol=1e-5)
        assert (want - untempered).abs().max() > 1e-2, "T=0.5 must change the log-probs"
    # The reference (the frozen base, SkyRL's ref worker) stays untempered.
    base = trainer.response_logprobs(None, batch)
    for row, want in enumerate(_reference(trainer, None, batch, 1.0)):
        torch.testing.assert_close(base[row, : len(want)], want, rtol=1e-5, atol=1e-5)


def test_the_sampler_and_the_trainer_agree_at_the_sampling_temperature(micro_model_dir: Path) -> None:
    """Tokens the sampler draws at T=0.5 (a fresh adapter is the base model): the log-probs it reports are the
    trainer's for the same tokens, and ``log_softmax(logits / 0.5)``'s."""
    trainer = _trainer(micro_model_dir, temperature=0.5)
    drawn = [_sampled(trainer, 0.5, seed) for seed in range(3)]
    batch = _batch([tokens for tokens, _ in drawn])
    got = trainer.response_logprobs("A", batch)
    for row, (tokens, reported) in enumerate(drawn):
        torch.testing.assert_close(got[row, : len(tokens)], torch.tensor(reported, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-5)
    untempered = _reference(trainer, None, batch, 1.0)
    assert max((got[row, : len(t)] - untempered[row]).abs().max() for row, (t, _) in enumerate(drawn)) > 1e-2


def test_packed_tenants_each_score_at_their_own_temperature(micro_model_dir: Path) -> None:
    """Packed mode: tenant B's own temperature (its algorithm override) applies to its rows only; the update's
    log-probs (``mean_token_logprob``, before the step) are the tempered ones."""
    trainer = _trainer(micro_model_dir, temperature=0.5, slots=2)
    trainer.store.tenants["B"].algorithm = AlgorithmConfig(use_kl_loss=False, temperature=2.0)
    batch = _batch([[30, 31, 32, 2], [40, 41, 2]])
    expected = {name: _reference(trainer, name, batch, t) for name, t in (("A", 0.5), ("B", 2.0))}
    results = trainer.train_packed([("A", batch), ("B", batch)])
    tokens = sum(len(r) for r in batch.response_ids)
    for (name, want), (_, metrics) in zip(expected.items(), results):
        assert metrics["mean_token_logprob"] == pytest.approx(float(sum(w.sum() for w in want)) / tokens, abs=1e-5)
