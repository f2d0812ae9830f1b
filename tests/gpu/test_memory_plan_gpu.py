"""The GPU memory plan: the trainer's measured peak is left free beside the KV blocks it plans, so that a
training pass of the planned shape runs after the engine took its blocks, within the planned budget."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

pytestmark = pytest.mark.gpu


def _random_model(**config: int) -> Qwen3ForCausalLM:
    """A bf16 Qwen3 model of ``config`` with random weights (seed 0) on the GPU."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen3ForCausalLM(Qwen3Config(**config)).to(torch.bfloat16).eval()


def test_a_training_pass_of_the_planned_shape_fits_beside_the_planned_kv_blocks() -> None:
    from skyrl.train.config import AlgorithmConfig

    from skyrl_clora.backends.embedded.memory_plan import measure_training_peak, plan_kv_blocks
    from skyrl_clora.sampler.engine import Engine
    from skyrl_clora.sampler.engine_config import EngineConfig
    from skyrl_clora.sampler.engine_thread import EngineThread
    from skyrl_clora.backends.embedded.services import share_base_weights
    from skyrl_clora.trainer.adapter_store import AdapterStore
    from skyrl_clora.trainer.trainer import OptimizerConfig, Trainer, TrainerSettings

    model = _random_model(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    sampler_layers, trainer_model, routing, trainer_layers = share_base_weights(model, 2, 1, 8)
    store = AdapterStore(trainer_layers, num_slots=1)
    trainer = Trainer(trainer_model, routing, trainer_layers, store, TrainerSettings(AlgorithmConfig(),
                                                                                     OptimizerConfig(),
                      micro_batch_size=8))
    plan = plan_kv_blocks(model, trainer, utilization=0.3, block_size=32, rows=32, max_len=1024, micro_batch_rows=8,
                          pack=1, rank=8)
    assert plan.training_peak > 0 and plan.kv_blocks > 32
    engine = EngineThread(Engine(model, sampler_layers,
                                 EngineConfig(num_rows=32, max_len=1024, block_size=32, num_blocks=plan.kv_blocks)))
    try:
        torch.cuda.reset_peak_memory_stats()
        measure_training_peak(trainer, 1, 8, 1024, 8)
        assert torch.cuda.max_memory_allocated() <= plan.budget
    finally:
        engine.shutdown()


def test_an_engine_of_2048_rows_keeps_its_graphs_and_workspaces_within_the_plans_reserve() -> None:
    """The decode graphs (one per span bucket) share one logits buffer: a ``[span, V]`` output kept per graph
    would alone be ~10 GiB past the reserve at 2,048 rows and Qwen3's vocabulary."""
    from skyrl_clora.backends.embedded.memory_plan import GRAPH_RESERVE_BYTES, kv_block_bytes
    from skyrl_clora.sampler.engine import Engine
    from skyrl_clora.sampler.engine_config import EngineConfig
    from skyrl_clora.sampler.engine_thread import EngineThread
    from skyrl_clora.backends.embedded.services import share_base_weights

    model = _random_model(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    config = model.config
    sampler_layers, _, _, _ = share_base_weights(model, 4, 1, 8)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    blocks = 64
    engine = EngineThread(Engine(model, sampler_layers,
                                 EngineConfig(num_rows=2048, max_len=2048, block_size=128, num_blocks=blocks)))
    try:
        torch.cuda.synchronize()
        taken = torch.cuda.memory_allocated() - before - (blocks + 1) * kv_block_bytes(config, 128, torch.bfloat16)
        assert engine.stats.graph_capture_seconds > 0
        assert 0 < taken <= GRAPH_RESERVE_BYTES, f"{taken / 2**30:.2f} GiB"
    finally:
        engine.shutdown()


def _prefill_pool_growth(prompt_lengths: list[int]) -> int:
    """Bytes the allocator reserves while a fresh engine (expandable segments, as the run sets) prefills
    ``prompt_lengths`` one prompt at a time, each pass of a new flat-batch size capturing its own graph."""
    from skyrl_clora.device.cuda_settings import use_expandable_segments
    from skyrl_clora.sampler.fused_projections import attach_engine_lora
    from skyrl_clora.sampler.engine import Engine
    from skyrl_clora.sampler.engine_config import EngineConfig
    from skyrl_clora.sampler.engine_thread import EngineThread
    from skyrl_clora.sampler.requests import SamplingParams

    use_expandable_segments()
    model = _random_model(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)
    _, layers = attach_engine_lora(model, num_slots=2, max_rank=8)
    engine = EngineThread(Engine(model, layers,
                                 EngineConfig(num_rows=16, max_len=4096, block_size=128, max_prefills_per_step=32)))
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        for length in prompt_lengths:
            prompt = torch.randint(512, (length,)).tolist()
            engine.submit(prompt, None, SamplingParams(max_tokens=1, temperature=0.0)).result(timeout=300)
        torch.cuda.synchronize()
        graphs = len(engine.engine.runner._prefill_graphs)
        assert graphs >= min(len(prompt_lengths), 8), f"{graphs} prefill graphs"
        return torch.cuda.memory_reserved() - before
    finally:
        engine.shutdown()
        del engine, model, layers
        torch.cuda.empty_cache()


def test_prefill_graphs_of_every_size_take_about_what_the_largest_alone_takes() -> None:
    """Prefill graphs share one pool and one capture stream: on a stream per capture the allocator cannot
    reuse the blocks earlier captures freed, and the pool grows with every size (about 4x the largest alone
    here). Sizes ascend, the pool's worst order."""
    largest = _prefill_pool_growth([4000])
    every = _prefill_pool_growth([20, 40, 100, 200, 400, 700, 1000, 1500, 2000, 2600, 3000, 3500, 4000])
    assert every <= 1.5 * largest + (64 << 20), f"{every / 2**20:.0f} vs {largest / 2**20:.0f} MiB"
