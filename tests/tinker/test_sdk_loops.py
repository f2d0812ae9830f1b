"""The real tinker SDK (0.38) against ``python -m skyrl_clora.tinker.server`` with the ``clora`` backend on the micro
model (CPU): a supervised loop (and its sampler's prompt log-probs) and an RL loop (sample -> reward ->
importance_sampling forward_backward -> optim_step -> save_weights_for_sampler) learn; four clients training at once
each end bit-equal to themselves alone (losses and saved sampler weights); a client's sample after its publish is of
its own latest weights, never another client's or an older version."""

from __future__ import annotations

import concurrent.futures
import io
import tarfile
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.tinker.conftest import TinkerServer

pytestmark = pytest.mark.e2e
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
RL_ADAM = types.AdamParams(learning_rate=5e-2, beta1=0.9, beta2=0.95, eps=1e-8)
PROMPT = [11, 42, 7, 99, 13]


def _supervised(training: tinker.TrainingClient, target: list[int], steps: int) -> list[float]:
    """``steps`` of cross entropy on ``PROMPT + target`` (weights on the target only); the losses."""
    tokens = PROMPT + target
    weights = [0.0] * (len(PROMPT) - 1) + [1.0] * len(target)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
    losses = []
    for _ in range(steps):
        losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(ADAM).result()
    return losses


def _greedy(sampler: tinker.SamplingClient, tokens: int) -> list[int]:
    params = types.SamplingParams(max_tokens=tokens, temperature=0.0, seed=0)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0].tokens


def test_a_supervised_loop_learns_its_target(clora_server: TinkerServer) -> None:
    target = [5, 6, 7, 8, 9, 10]
    with tinker.ServiceClient(base_url=clora_server.url, api_key=clora_server.key) as service:
        training = service.create_lora_training_client(base_model=clora_server.base_model, rank=4, seed=1).result()
        before = _greedy(training.save_weights_and_get_sampling_client().result(), len(target))
        losses = _supervised(training, target, steps=16)
        sampler = training.save_weights_and_get_sampling_client().result()
        after = _greedy(sampler, len(target))
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + target)).result()
    assert before != target and after == target
    assert losses[-1] < 0.3 * losses[0]
    assert scored[0] is None and len(scored) == len(PROMPT + target)
    assert sum(scored[len(PROMPT):]) == pytest.approx(-losses[-1], rel=0.5)  # the target is likely now


def test_an_rl_loop_with_importance_sampling_raises_its_reward(clora_server: TinkerServer) -> None:
    """Reward: 1 for each sampled token below 200 (half the micro model's vocabulary); the advantage of a token is its
    reward less the step's mean."""
    rewards = []
    with tinker.ServiceClient(base_url=clora_server.url, api_key=clora_server.key) as service:
        training = service.create_lora_training_client(base_model=clora_server.base_model, rank=8, seed=3).result()
        for step in range(16):
            sampler = training.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=100 + step)
            sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), 8, params).result().sequences
            scores = [[float(token < 200) for token in s.tokens] for s in sequences]  # a reward per token
            mean = sum(map(sum, scores)) / sum(map(len, scores))
            rewards.append(mean)
            datums = []
            for sequence, score in zip(sequences, scores):
                tokens = PROMPT + sequence.tokens
                prompt_zeros = [0.0] * (len(PROMPT) - 1)
                datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": tokens[1:], "logprobs": prompt_zeros + list(sequence.logprobs),
                    "advantages": prompt_zeros + [value - mean for value in score]}))
            training.forward_backward(datums, "importance_sampling").result()
            training.optim_step(RL_ADAM).result()
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards


def _client_run(server: TinkerServer, seed: int, name: str) -> tuple[list[float], bytes]:
    """One client's supervised loop in its own session: its losses and its saved sampler weights' bytes."""
    target = [20 + seed, 30 + seed, 40 + seed, 50 + seed]
    with tinker.ServiceClient(base_url=server.url, api_key=server.key) as service:
        training = service.create_lora_training_client(base_model=server.base_model, rank=2 + seed, seed=seed).result()
        losses = _supervised(training, target, steps=4)
        training.save_weights_for_sampler(name=name).result()
        archive = next(Path(server.log.parent).rglob(f"sampler_weights/{name}.tar.gz"))
    with tarfile.open(archive, "r:gz") as members:
        weights = members.extractfile("adapter_model.safetensors").read()
    return losses, weights


def test_four_clients_at_once_each_equal_themselves_alone(clora_server: TinkerServer) -> None:
    seeds = [1, 2, 3, 4]
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        together = list(pool.map(lambda seed: _client_run(clora_server, seed, f"together-{seed}"), seeds))
    alone = [_client_run(clora_server, seed, f"alone-{seed}") for seed in seeds]
    assert len({weights for _, weights in together}) == len(seeds)  # the clients' adapters differ
    for (losses, weights), (losses_alone, weights_alone) in zip(together, alone):
        assert losses == losses_alone and weights == weights_alone


def test_a_sample_after_a_publish_is_of_the_clients_own_latest_weights(clora_server: TinkerServer) -> None:
    targets = {"a": [5, 6, 7, 8], "b": [60, 61, 62, 63]}
    with tinker.ServiceClient(base_url=clora_server.url, api_key=clora_server.key) as service:
        create = service.create_lora_training_client
        clients = {name: create(base_model=clora_server.base_model, rank=4, seed=seed).result()
                   for name, seed in (("a", 7), ("b", 8))}
        for name, training in clients.items():
            _supervised(training, targets[name], steps=16)
        samplers = {name: training.save_weights_and_get_sampling_client().result()
                    for name, training in clients.items()}
        params = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)
        pending = {name: sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params)
                   for name, sampler in samplers.items()}  # both in flight at once: one engine batch
        assert {name: future.result().sequences[0].tokens for name, future in pending.items()} == targets
        _supervised(clients["a"], [9, 9, 9, 9], steps=2)
        latest = clients["a"].save_weights_and_get_sampling_client().result()
        # the SDK retries a failed future, then raises ValueError with the server's error
        with pytest.raises(ValueError, match="was replaced by a later save_weights_for_sampler"):
            samplers["a"].sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
        assert _greedy(samplers["b"], 4) == targets["b"]  # b's sampler is still b's latest
        assert _greedy(latest, 4) != targets["b"]
