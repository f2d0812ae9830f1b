"""The session fixtures every test folder may use (registered by tests/conftest.py): a micro Qwen3 model (random
weights) with the project's chat tokenizer, saved in HF format, the same made learnable on the micro task, and a
view of the machine without the production extras."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.recipes.gsm8k.problems import make_dataset_rows
from skyrl_clora.tiny_base.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3 with random weights (large enough that adapters and tenants visibly differ) and
    the project's chat tokenizer trained on GSM8K-format task text, saved with save_pretrained."""
    out = tmp_path_factory.mktemp("micro-model")
    rows = make_dataset_rows(200, seed=0)
    corpus = [message["content"] for row in rows for message in row["prompt"]]
    corpus += ['<tool_call>{"name": "calculator", "arguments": {"expression": "4*17+23"}}</tool_call>'] * 20
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08, generator=generator)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def learning_model_dir(micro_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The micro model made learnable on the micro task in a few steps (``micro_task.make_learnable_model``)."""
    from tests.support.micro_task import make_learnable_model

    return make_learnable_model(micro_model_dir, tmp_path_factory.mktemp("learning-model"))


@pytest.fixture
def without_production_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm and megatron-core look absent whether or not they are installed, so backend=skyrl tests pick (and
    refuse) what they would on a machine without them: the embedded stand-ins."""
    import importlib.util

    find_spec = importlib.util.find_spec

    def find_spec_without_extras(name: str, *args, **kwargs):
        return None if name.split(".")[0] in ("vllm", "megatron") else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_extras)
