"""The GPU memory plan: the trainer's measured peak is left free beside the KV blocks it plans, so that a
training pass of the planned shape runs after the engine took its blocks, within the planned budget."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_training_pass_of_the_planned_shape_fits_beside_the_planned_kv_blocks() -> None:
    from skyrl.train.config import AlgorithmConfig

    from skyrl_clora.memory_plan import measure_training_peak, plan_kv_blocks
    from skyrl_clora.sampler.engine import Engine
    from skyrl_clora.services import share_base_weights
    from skyrl_clora.trainer.adapter_store import AdapterStore
    from skyrl_clora.trainer.trainer import OptimizerConfig, Trainer

    config = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    sampler_layers, trainer_model, routing, trainer_layers = share_base_weights(model, 2, 1, 8)
    store = AdapterStore(trainer_layers, num_slots=1)
    trainer = Trainer(trainer_model, routing, trainer_layers, store, AlgorithmConfig(), OptimizerConfig(),
                      micro_batch_size=8)
    plan = plan_kv_blocks(model, trainer, utilization=0.3, block_size=32, rows=32, max_len=1024, micro_batch_rows=8,
                          pack=1, rank=8)
    assert plan.training_peak > 0 and plan.kv_blocks > 32
    engine = Engine(model, sampler_layers, num_rows=32, max_len=1024, block_size=32, num_blocks=plan.kv_blocks)
    try:
        torch.cuda.reset_peak_memory_stats()
        measure_training_peak(trainer, 1, 8, 1024, 8)
        assert torch.cuda.max_memory_allocated() <= plan.budget
    finally:
        engine.shutdown()
