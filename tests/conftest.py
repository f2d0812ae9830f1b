"""Shared fixtures: a micro Qwen3 model (random weights) with the project's tokenizer, saved in HF format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skyrl_clora.recipes.tiny_base.pretrain import TinyBaseRecipe, build_tokenizer, make_model, synthetic_episodes

MICRO_RECIPE = TinyBaseRecipe(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              intermediate_size=128, num_traces=200, vocab_size=400, steps=1, batch_size=1)


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3 with random weights (scaled up so that adapters and tenants visibly differ) and
    the project's chat tokenizer, saved with save_pretrained."""
    out = tmp_path_factory.mktemp("micro-model")
    tokenizer = build_tokenizer(synthetic_episodes(MICRO_RECIPE), MICRO_RECIPE.vocab_size)
    model = make_model(MICRO_RECIPE, tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08, generator=generator)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
