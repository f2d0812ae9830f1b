"""Versioned in-place publication into the sampler (skyrl_clora.backends.embedded.sync): a tenant registers at version
0, each publish lands as the next version (the sampler then serves those weights, and requests are sampled with that
version) and reports the seconds until it was applied, a resumed tenant's adapter lands as the version it is given,
and an unregistered tenant is gone from the sampler while the others keep their versions."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.backends.embedded.sync import AdapterSync
from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.helpers import random_adapter, start_engine


def _engine() -> EngineThread:
    """An engine thread on a tiny random Qwen3 with no adapter registered."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return start_engine(Qwen3ForCausalLM(config).eval(), EngineConfig(num_rows=2, max_len=32), {})[0]


def _served(engine: EngineThread, tenant: str, like: AdapterWeights) -> bool:
    """Whether the sampler serves exactly ``like`` as ``tenant``."""
    served = engine.engine.adapters.read(tenant, like.rank, like.alpha)
    return all(torch.equal(served.a[path], like.a[path]) and torch.equal(served.b[path], like.b[path])
               for path in like.a)


def test_each_publish_lands_as_the_tenants_next_version() -> None:
    engine = _engine()
    sync = AdapterSync(engine)
    layers = engine.engine.lora_layers
    first, second, third, other = (random_adapter(layers, seed) for seed in (1, 2, 3, 4))
    try:
        sync.register("t", first)
        sync.register("u", other)
        assert (sync.version("t"), sync.version("u")) == (0, 0) and _served(engine, "t", first)
        version, seconds = asyncio.run(sync.publish("t", second))
        assert version == 1 and seconds >= 0.0 and sync.version("t") == 1 and _served(engine, "t", second)
        assert asyncio.run(sync.publish("t", third))[0] == 2 and _served(engine, "t", third)
        completion = engine.submit([5, 6, 7], "t", SamplingParams(max_tokens=2)).result(timeout=60)
        assert completion.adapter_version == 2
        assert sync.version("u") == 0 and _served(engine, "u", other), "another tenant keeps its own"
    finally:
        engine.shutdown()


def test_a_resumed_tenants_adapter_lands_as_the_version_given_and_publishes_go_on_from_it() -> None:
    engine = _engine()
    sync = AdapterSync(engine)
    layers = engine.engine.lora_layers
    try:
        sync.register("t", random_adapter(layers, 1))
        checkpointed = random_adapter(layers, 2)
        asyncio.run(sync.publish_as("t", checkpointed, 7))
        assert sync.version("t") == 7 and _served(engine, "t", checkpointed)
        assert asyncio.run(sync.publish("t", random_adapter(layers, 3)))[0] == 8
    finally:
        engine.shutdown()


def test_an_unregistered_tenant_is_gone_from_the_sampler() -> None:
    engine = _engine()
    sync = AdapterSync(engine)
    layers = engine.engine.lora_layers
    try:
        sync.register("t", random_adapter(layers, 1))
        sync.register("u", random_adapter(layers, 2))
        asyncio.run(sync.unregister("t"))
        assert "t" not in engine.engine.adapters and sync.version("u") == 0
        with pytest.raises(KeyError):
            sync.version("t")
        with pytest.raises(KeyError):
            asyncio.run(sync.publish("t", random_adapter(layers, 3)))
        with pytest.raises(ValueError, match="unknown adapter 't'"):
            asyncio.run(sync.unregister("t"))
    finally:
        engine.shutdown()
