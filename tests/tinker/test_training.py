"""Tinker's training calls on the embedded trainer (skyrl_clora.tinker.training), on the micro model (CPU): models
start at the base model and differ once trained; gradients of several forward_backward calls add up until the
optim_step, also with another model's calls swapped in between, where the model ends bit-equal to itself alone; each
optim_step takes its own Adam settings; a saved state loads back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skyrl_clora.backends.embedded.services import build_services
from skyrl_clora.tinker.backend import CloraTinkerConfig, tinker_run_config
from skyrl_clora.tinker.training import Datum, TinkerTrainer

ADAM = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


def _training(model_dir: Path) -> TinkerTrainer:
    config = CloraTinkerConfig(max_lora_adapters=2, max_rows=4, max_sequence_length=128, micro_batch_tokens=64,
                               overrides=["clora.device=cpu"])
    services = build_services(tinker_run_config(str(model_dir), config), str(model_dir), 2, 2)
    services.engine.shutdown()  # these tests train only
    training = TinkerTrainer(services.trainer, config.micro_batch_tokens)
    training.create("a", rank=4, alpha=8.0, seed=1)
    training.create("b", rank=8, alpha=16.0, seed=2)
    return training


def _datum(seed: int, length: int = 10) -> Datum:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, 300, (length + 1,), generator=generator).tolist()
    return Datum(tokens[:-1], tokens[1:], [1.0] * length)


def _flat(training: TinkerTrainer, model: str) -> torch.Tensor:
    weights = training.host_weights(model)
    return torch.cat([t.float().flatten() for path in sorted(weights.a) for t in (weights.a[path], weights.b[path])])


def _logprobs(training: TinkerTrainer, model: str, datum: Datum) -> torch.Tensor:
    return training.pass_datums(model, [datum], "cross_entropy", None, backward=False)[0].logprobs


def test_models_start_at_the_base_model_and_differ_once_trained(micro_model_dir: Path) -> None:
    training = _training(micro_model_dir)
    probe = _datum(99)
    before_a, before_b = _logprobs(training, "a", probe), _logprobs(training, "b", probe)
    assert torch.equal(before_a, before_b)  # B = 0: both are the base model
    training.pass_datums("a", [_datum(1)], "cross_entropy", None, backward=True)
    training.optim_step("a", 1e-2, **ADAM)
    after_a, after_b = _logprobs(training, "a", probe), _logprobs(training, "b", probe)
    assert not torch.equal(after_a, after_b)
    assert torch.equal(after_b, before_b)


def test_gradients_add_up_across_calls_and_a_model_beside_another_equals_itself_alone(micro_model_dir: Path) -> None:
    d1, d2, other = _datum(1), _datum(2, length=7), _datum(3)
    alone = _training(micro_model_dir)
    alone.pass_datums("a", [d1], "cross_entropy", None, backward=True)
    alone.pass_datums("a", [d2], "cross_entropy", None, backward=True)
    alone.optim_step("a", 1e-2, **ADAM)

    beside = _training(micro_model_dir)
    beside.pass_datums("a", [d1], "cross_entropy", None, backward=True)
    beside.pass_datums("b", [other], "cross_entropy", None, backward=True)  # swaps a out, gradients pending
    beside.optim_step("b", 1e-2, **ADAM)
    beside.pass_datums("a", [d2], "cross_entropy", None, backward=True)
    beside.optim_step("a", 1e-2, **ADAM)
    assert not torch.equal(_flat(beside, "b"), _flat(alone, "b"))  # b trained beside a
    assert torch.equal(_flat(beside, "a"), _flat(alone, "a"))

    one_call = _training(micro_model_dir)
    one_call.pass_datums("a", [d1, d2], "cross_entropy", None, backward=True)
    one_call.optim_step("a", 1e-2, **ADAM)
    # the same sum in another order: float noise, far below the step's ~1e-2 change of each master
    torch.testing.assert_close(_flat(one_call, "a"), _flat(alone, "a"), rtol=1e-5, atol=1e-6)
    assert not torch.equal(_flat(one_call, "a"), _flat(one_call, "b"))


def test_each_optim_step_takes_its_own_adam_settings(micro_model_dir: Path) -> None:
    runs = {}
    for lr in (0.0, 1e-3, 1e-2):
        training = _training(micro_model_dir)
        start = _flat(training, "a")
        training.pass_datums("a", [_datum(1)], "cross_entropy", None, backward=True)
        norm = training.optim_step("a", lr, **ADAM)
        runs[lr] = _flat(training, "a")
        assert norm > 0
        if lr == 0.0:
            assert torch.equal(runs[lr], start)
    assert not torch.equal(runs[1e-3], runs[1e-2])
    delta_small, delta_large = (runs[1e-3] - runs[0.0]).abs().max(), (runs[1e-2] - runs[0.0]).abs().max()
    assert delta_large > 5 * delta_small  # Adam's first step moves each weight by about lr


def test_a_saved_state_loads_back_bit_for_bit(micro_model_dir: Path, tmp_path: Path) -> None:
    training = _training(micro_model_dir)
    training.pass_datums("a", [_datum(1)], "cross_entropy", None, backward=True)
    training.optim_step("a", 1e-2, **ADAM)
    training.pass_datums("a", [_datum(2)], "cross_entropy", None, backward=True)  # gradients pending at the save
    training.save_state("a", tmp_path / "a")
    saved = {table: tensor.clone() for table, tensor in training.store.tenants["a"].flat.items()}
    training.optim_step("a", 1e-2, **ADAM)
    training.load_state("a", tmp_path / "a", with_optimizer=True)
    state = training.store.tenants["a"]
    assert all(torch.equal(state.flat[table], saved[table]) for table in saved) and state.step == 1
    training.load_state("a", tmp_path / "a", with_optimizer=False)
    assert torch.equal(state.flat["master"], saved["master"]) and state.step == 0
    assert not state.flat["exp_avg"].any() and not state.flat["grads"].any()


def test_a_datum_whose_lengths_disagree_is_refused(micro_model_dir: Path) -> None:
    training = _training(micro_model_dir)
    with pytest.raises(ValueError, match="^a datum needs as many target tokens and weights as input tokens"):
        training.pass_datums("a", [Datum([1, 2, 3], [2, 3], [1.0, 1.0, 1.0])], "cross_entropy", None, backward=True)
    with pytest.raises(ValueError, match="^model 'c' does not exist on this server$"):
        training.pass_datums("c", [_datum(1)], "cross_entropy", None, backward=True)


def test_prompt_logprobs_are_those_of_the_given_weights_or_the_base_and_leave_the_live_model_alone(
        micro_model_dir: Path) -> None:
    prompt = _datum(5).tokens
    as_datum = Datum(prompt[:-1], prompt[1:], [1.0] * (len(prompt) - 1))
    runs = {}
    for scoring in (True, False):
        training = _training(micro_model_dir)
        base = training.prompt_logprobs(None, [prompt])[0] if scoring else None
        training.pass_datums("a", [_datum(1)], "cross_entropy", None, backward=True)
        training.optim_step("a", 1e-2, **ADAM)
        published = training.host_weights("a")
        training.pass_datums("a", [_datum(2)], "cross_entropy", None, backward=True)  # a live, gradients pending
        if scoring:
            assert base == _logprobs(training, "b", as_datum).tolist()  # b is still the base model
            scored = training.prompt_logprobs(published, [prompt])[0]
            assert scored != base
        training.optim_step("a", 1e-2, **ADAM)
        runs[scoring] = _flat(training, "a")
        if scoring:
            assert "clora-tinker-scoring" not in training.store.tenants
            one_step = _training(micro_model_dir)
            one_step.pass_datums("a", [_datum(1)], "cross_entropy", None, backward=True)
            one_step.optim_step("a", 1e-2, **ADAM)
            assert scored == _logprobs(one_step, "a", as_datum).tolist()  # the published weights' own log-probs
    assert torch.equal(runs[True], runs[False])  # scoring left a's live state (and pending gradients) alone
