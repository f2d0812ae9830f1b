"""The engine's adapter slots as a cache on the GPU: 32 tenants on 4 device slots (loaded from pinned host copies
between CUDA-graph decode steps, least recently used out) sample what they sample with a slot each. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.helpers import random_adapter

pytestmark = pytest.mark.gpu

PROMPT = list(range(7, 47))
# fp32 log-probs of one request on engines whose folded GEMMs have other widths (4 or 32 slots' extra columns):
# cuBLAS may pick another kernel per width, so the sums round differently; tokens are the same.
LOGPROB_TOLERANCE = 1e-3


def test_32_tenants_on_4_slots_sample_what_they_sample_on_32() -> None:
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    runs, stats, adapters = {}, {}, None
    for slots in (32, 4):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(config).eval()
        _, layers = attach_engine_lora(model, num_slots=slots, max_rank=16)
        if adapters is None:
            adapters = {f"t{i}": random_adapter(layers, i, b_std=0.05) for i in range(32)}  # host tensors
        engine = EngineThread(Engine(model, layers, EngineConfig(num_rows=32, max_len=128, block_size=32)))
        try:
            for name, weights in adapters.items():
                engine.register_adapter(name, weights)
            assert engine.engine.adapters.pin and engine.engine.runner._graphs
            engine.pause()
            futures = [engine.submit(PROMPT[: 20 + 8 * k], name, SamplingParams(max_tokens=12 + 4 * k, seed=k))
                       for k in range(2) for name in adapters]  # each tenant's second request 31 others behind
            engine.resume()
            runs[slots] = [future.result(timeout=300) for future in futures]
            stats[slots] = engine.stats
        finally:
            engine.shutdown()
    assert len({tuple(c.token_ids) for c in runs[32][:32]}) >= 30, "tenants' samples must differ"
    assert [c.token_ids for c in runs[4]] == [c.token_ids for c in runs[32]]
    worst = max(max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) for a, b in zip(runs[4], runs[32]))
    assert worst < LOGPROB_TOLERANCE, worst
    assert (stats[32].adapter_loads, stats[32].adapter_evictions) == (32, 0)
    assert (stats[4].adapter_hits, stats[4].adapter_loads, stats[4].adapter_evictions) == (0, 64, 60)
