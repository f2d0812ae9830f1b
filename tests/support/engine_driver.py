"""Driving an :class:`Engine` round by round from a test, without its thread: adapters registered and published,
requests and publishes queued through its scheduler as the engine thread queues them, and rounds stepped until a
condition holds (a bound on the rounds: reaching it fails the test)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path

from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import Completion, Publish, QueuedRequest, SamplingParams, Unregister

from tests.support.helpers import random_adapter

PROMPT = list(range(5, 25))
MAX_ROUNDS = 2000  # a bound on every engine-driving loop: reaching it fails the test


def make_engine(model_dir: Path, slots: int, num_rows: int = 8, **config: object) -> Engine:
    """An engine on the model in ``model_dir`` with ``slots`` LoRA slots of rank 8, ``num_rows`` rows of 64
    positions and the other :class:`EngineConfig` fields ``config``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    _, layers = attach_engine_lora(model, num_slots=slots, max_rank=8)
    return Engine(model, layers, EngineConfig(num_rows=num_rows, max_len=64, **config))


def make_adapters(model_dir: Path, seeds: dict[str, int]) -> dict[str, AdapterWeights]:
    """Random adapters (host tensors) for the model's engine layers, by name (name -> seed)."""
    layers = make_engine(model_dir, slots=1).lora_layers
    return {name: random_adapter(layers, seed) for name, seed in seeds.items()}


def register(engine: Engine, weights: dict[str, AdapterWeights]) -> None:
    """Registers each adapter of ``weights`` with its weights as version 0."""
    for name, adapter in weights.items():
        engine.adapters.register(name)
        engine.adapters.publish(name, engine.adapters.host_copy(adapter), 0)


def submit(engine: Engine, adapter: str | None, seed: int, max_tokens: int = 6, prompt: list[int] = PROMPT
           ) -> concurrent.futures.Future:
    """Queues one request of ``adapter`` (sampled with ``seed``)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    engine.scheduler.enqueue(QueuedRequest(list(prompt), adapter, SamplingParams(max_tokens=max_tokens, seed=seed),
                                           future))
    return future


def publish(engine: Engine, adapter: str, weights: AdapterWeights, version: int) -> concurrent.futures.Future:
    """Queues ``weights`` as ``adapter``'s ``version`` (it lands once none of its requests runs)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    engine.scheduler.enqueue(Publish(adapter, engine.adapters.host_copy(weights), version, future))
    return future


def unregister(engine: Engine, adapter: str) -> concurrent.futures.Future:
    """Queues the removal of ``adapter`` (it lands once none of its requests runs; its waiting ones fail)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    engine.scheduler.enqueue(Unregister(adapter, future))
    return future


def run_until(engine: Engine, done: Callable[[], bool]) -> None:
    """Steps ``engine`` until ``done()`` (at most :data:`MAX_ROUNDS` rounds)."""
    for _ in range(MAX_ROUNDS):
        if done():
            return
        engine.step()
    raise AssertionError(f"not done after {MAX_ROUNDS} engine rounds")


def sampled(completion: Completion) -> tuple:
    """What a request sampled: its tokens, their log-probs and why it stopped."""
    return completion.token_ids, completion.logprobs, completion.finish_reason
