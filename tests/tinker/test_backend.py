"""SkyRL's Tinker backend API over the embedded engine and trainer (skyrl_clora.tinker.backend), on the micro model
(CPU), called as SkyRL's Tinker engine calls it: models sampled in one batch differ once one is trained and published;
a sample is served only from the version its checkpoint names, its prompt log-probs too; unsupported sampling
options fail alone with their name; the server's limits on models and ranks; forward_backward's outputs; a training
checkpoint's round trip; SkyRL's continuous sampling path answers as its serial one; a sequence ends at EOS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from skyrl.tinker import types

from skyrl_clora.tinker.backend import CloraTinkerBackend, CloraTinkerConfig

ADAM = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                                                         weight_decay=0.0))
PROMPT = [11, 42, 7, 99, 13]


@pytest.fixture
def backend(micro_model_dir: Path):
    config = CloraTinkerConfig(max_lora_adapters=2, max_lora_rank=8, max_rows=8, max_sequence_length=128,
                               overrides=["clora.device=cpu"])
    backend = CloraTinkerBackend(str(micro_model_dir), config)
    backend.create_model("a", types.LoraConfig(rank=4, alpha=32.0, seed=1))
    backend.create_model("b", types.LoraConfig(rank=8, alpha=32.0, seed=2))
    yield backend
    backend.shutdown()


def _input(tokens: list[int]) -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tokens)])


def _pass(model: str, sequences: list[list[int]], loss_fn: str = "cross_entropy") -> types.PreparedModelPassBatch:
    n = len(sequences)
    return types.PreparedModelPassBatch(
        all_model_inputs=[_input(s[:-1]) for s in sequences], all_targets=[s[1:] for s in sequences],
        all_token_weights=[[1.0] * (len(s) - 1) for s in sequences], all_sampling_logprobs=[[] for _ in sequences],
        all_advantages=[[] for _ in sequences], all_values=[[] for _ in sequences], all_returns=[[] for _ in sequences],
        all_model_ids=[model] * n, all_loss_fns=[loss_fn] * n, all_loss_fn_configs=[None] * n,
        request_batch_slices=[("fb", model, 0, n)])


def _samples(requests: list[tuple[str, str, str, dict]], prompt_logprobs: bool = False) -> types.PreparedSampleBatch:
    """One sample per request: (request id, model, checkpoint id, sampling overrides); each asks for its prompt's
    log-probs with ``prompt_logprobs``."""
    params = [types.SamplingParams(**{"temperature": 1.0, "max_tokens": 12, "seed": 5, **extra})
              for *_, extra in requests]
    return types.PreparedSampleBatch(
        all_model_inputs=[_input(PROMPT)] * len(requests), all_sampling_params=params,
        all_model_ids=[model for _, model, _, _ in requests], all_checkpoint_ids=[ckpt for _, _, ckpt, _ in requests],
        all_checkpoint_paths=[""] * len(requests), all_session_ids=[None] * len(requests), needs_prompt_logprobs=False,
        request_batch_slices=[(rid, model, i, i + 1, prompt_logprobs, 0)
                              for i, (rid, model, _, _) in enumerate(requests)])


def _train(backend: CloraTinkerBackend, model: str, steps: int) -> None:
    target = [PROMPT + [5, 6, 7, 8, 9, 10]]
    for _ in range(steps):
        backend.forward_backward(_pass(model, target))
        backend.optim_step(model, ADAM)


def _save(backend: CloraTinkerBackend, tmp_path: Path, model: str, checkpoint: str) -> None:
    backend.save_sampler_checkpoint(tmp_path / model / "sampler_weights" / f"{checkpoint}.tar.gz", model, persist=False)


def test_models_in_one_sample_batch_differ_once_one_is_trained_and_published(backend, tmp_path: Path) -> None:
    _save(backend, tmp_path, "a", "a0")
    _save(backend, tmp_path, "b", "b0")
    untrained = backend.sample(_samples([("a", "a", "a0", {}), ("b", "b", "b0", {}), ("base", "", "", {})]))
    first_tokens = [untrained[name].sequences[0].tokens for name in ("a", "b", "base")]
    assert first_tokens[0] == first_tokens[1] == first_tokens[2]  # B = 0: every adapter is the base model
    _train(backend, "a", steps=16)
    _save(backend, tmp_path, "a", "a1")
    mixed = backend.sample(_samples([("a", "a", "a1", {}), ("b", "b", "b0", {}), ("base", "", "", {}),
                                     ("greedy", "a", "a1", {"temperature": 0.0})]))
    assert mixed["a"].sequences[0].tokens != mixed["b"].sequences[0].tokens  # the tenants' outputs differ
    assert mixed["b"].sequences[0] == untrained["b"].sequences[0]  # b is untouched by a's training and publish
    assert mixed["base"].sequences[0] == untrained["base"].sequences[0]
    assert mixed["greedy"].sequences[0].tokens[:6] == [5, 6, 7, 8, 9, 10]  # a learnt its target


def test_a_sample_is_served_only_from_the_version_its_checkpoint_names(backend, tmp_path: Path) -> None:
    _save(backend, tmp_path, "a", "first")
    _train(backend, "a", steps=1)
    _save(backend, tmp_path, "a", "second")
    results = backend.sample(_samples([("old", "a", "first", {}), ("new", "a", "second", {}), ("none", "a", "x", {})]))
    assert results["old"].error.startswith("sampler checkpoint 'first' of 'a' was replaced by a later")
    assert results["none"].error == "model 'a' has no sampler checkpoint 'x'"
    assert isinstance(results["new"], types.SampleOutput) and len(results["new"].sequences[0].tokens) > 0
    assert backend.services.engine.adapter_version("a") == 2 and backend.services.engine.adapter_version("b") == 0


def test_unsupported_sampling_options_fail_alone_with_their_name(backend, tmp_path: Path) -> None:
    _save(backend, tmp_path, "b", "b0")
    results = backend.sample(_samples([("strings", "b", "b0", {"stop_strings": ["\n"]}),
                                       ("topk", "b", "b0", {"top_k": 5}), ("fine", "b", "b0", {"stop_tokens": [3]})]))
    assert results["strings"].error == "stop strings are not supported by the clora backend; pass stop token ids"
    assert results["topk"].error == "top_k=5 is not supported by the clora backend"
    assert isinstance(results["fine"], types.SampleOutput)


def test_the_servers_limits_on_models_and_ranks(backend) -> None:
    with pytest.raises(ValueError, match="^the server holds 2 models, its max_lora_adapters; delete one"):
        backend.create_model("c", types.LoraConfig(rank=4, alpha=32.0, seed=3))
    backend.delete_model("a")
    assert not backend.has_model("a")
    with pytest.raises(ValueError, match=r"^LoRA rank 16 is outside 1\.\.8"):
        backend.create_model("c", types.LoraConfig(rank=16, alpha=32.0, seed=3))
    backend.create_model("c", types.LoraConfig(rank=2, alpha=32.0, seed=3))
    assert backend.has_model("c")


def test_forward_backward_gives_each_datums_logprobs_and_losses_and_their_sum(backend) -> None:
    sequences = [PROMPT + [5, 6], PROMPT[:3]]
    output = backend.forward_backward(_pass("a", sequences))["fb"]
    assert [o["logprobs"]["shape"] for o in output.loss_fn_outputs] == [[6], [2]]
    losses = [value for o in output.loss_fn_outputs for value in o["elementwise_loss"]["data"]]
    logprobs = [value for o in output.loss_fn_outputs for value in o["logprobs"]["data"]]
    assert losses == [-value for value in logprobs]  # cross entropy, every weight 1
    assert output.metrics["loss:sum"] == pytest.approx(sum(losses), rel=1e-6)
    failed = backend.forward_backward(_pass("a", sequences, loss_fn="dppo"))["fb"]
    assert failed.error.startswith("loss_fn 'dppo' is not supported by the clora backend")


def test_a_training_checkpoint_round_trips_through_its_archive(backend, tmp_path: Path) -> None:
    _train(backend, "a", steps=2)
    backend.save_checkpoint(tmp_path / "a.tar.gz", "a")
    saved = {table: tensor.clone() for table, tensor in backend.training.store.tenants["a"].flat.items()}
    _train(backend, "a", steps=1)
    backend.load_checkpoint(tmp_path / "a.tar.gz", "a", load_optimizer=True)
    state = backend.training.store.tenants["a"]
    assert all(torch.equal(state.flat[table], saved[table]) for table in saved) and state.step == 2


def test_the_trainers_logprobs_of_sampled_tokens_are_the_samplers(backend, tmp_path: Path) -> None:
    """The first importance-sampling ratio of a freshly sampled sequence is 1: the trainer scores the sampled tokens
    as the engine drew them (temperature 1)."""
    _train(backend, "a", steps=2)
    _save(backend, tmp_path, "a", "a1")
    sequence = backend.sample(_samples([("s", "a", "a1", {})]))["s"].sequences[0]
    scored = backend.forward(_pass("a", [PROMPT + sequence.tokens]))["fb"].loss_fn_outputs[0]["logprobs"]["data"]
    torch.testing.assert_close(torch.tensor(scored[len(PROMPT) - 1:]), torch.tensor(sequence.logprobs),
                               rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_are_of_the_version_the_checkpoint_names_or_the_base(backend, tmp_path: Path) -> None:
    _train(backend, "a", steps=2)
    _save(backend, tmp_path, "a", "a1")
    expected = backend.forward(_pass("a", [PROMPT]))["fb"].loss_fn_outputs[0]["logprobs"]["data"]
    _train(backend, "a", steps=1)  # the trainer moves on; the sampler keeps a1
    results = backend.sample(_samples([("a", "a", "a1", {}), ("base", "", "", {})], prompt_logprobs=True))
    assert results["a"].prompt_logprobs[0] is None and len(results["a"].prompt_logprobs) == len(PROMPT)
    torch.testing.assert_close(torch.tensor(results["a"].prompt_logprobs[1:]), torch.tensor(expected), rtol=0, atol=0)
    base = backend.forward(_pass("b", [PROMPT]))["fb"].loss_fn_outputs[0]["logprobs"]["data"]  # b: the base model
    assert results["base"].prompt_logprobs[1:] == base != expected
    topk = backend.sample(_samples([("k", "a", "a1", {})]).model_copy(update={
        "request_batch_slices": [("k", "a", 0, 1, True, 3)]}))
    assert topk["k"].error == "top-k prompt log-probs are not supported by the clora backend"


def test_the_continuous_path_gives_what_the_serial_one_gives(backend, tmp_path: Path) -> None:
    _train(backend, "a", steps=2)
    _save(backend, tmp_path, "a", "a1")
    requests = [("a", "a", "a1", {}), ("base", "", "", {}), ("old", "b", "missing", {})]
    serial = backend.sample(_samples(requests, prompt_logprobs=True))
    continuous = asyncio.run(backend.sample_batch_async(_samples(requests, prompt_logprobs=True)))
    assert continuous == serial and isinstance(continuous["a"], types.SampleOutput)
    assert continuous["old"].error == "model 'b' has no sampler checkpoint 'missing'"


def test_a_sequence_ends_at_the_end_of_sequence_token(backend, tmp_path: Path) -> None:
    eos = backend.services.tokenizer.eos_token_id
    target = [PROMPT + [5, 6, eos]]
    for _ in range(16):
        backend.forward_backward(_pass("a", target))
        backend.optim_step("a", ADAM)
    _save(backend, tmp_path, "a", "a1")
    sequence = backend.sample(_samples([("g", "a", "a1", {"temperature": 0.0})]))["g"].sequences[0]
    assert sequence.tokens == [5, 6, eos] and sequence.stop_reason == "stop"
