"""The embedded tiny base's pre-training (:mod:`skyrl_clora.tiny_base.pretrain`): episodes that follow the solve
rate, micro pre-training with its cache and reload (and the eval harness on the result), a crashed build that leaves
no model, the recipe's cache key, and the corpus a recipe offers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

from skyrl_clora.recipes.gsm8k import make_dataset_rows
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.recipes.gsm8k.evaluate import evaluate_policy
from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, ensure_tiny_base, pretraining_episodes, tiny_base_path

MICRO = TinyBaseRecipe(corpus="gsm8k", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, num_traces=64, steps=12, prior_steps=4, batch_size=8, lr=1e-2, warmup_steps=2)


# ---- pre-training episodes ----------------------------------------------------------------------------


def test_episodes_follow_the_solve_rate() -> None:
    episodes = pretraining_episodes(TinyBaseRecipe(corpus="gsm8k", num_traces=1000), 0.35)
    rate = sum(len(turns) == 2 for _, turns in episodes) / len(episodes)
    assert 0.30 < rate < 0.40
    skill = pretraining_episodes(TinyBaseRecipe(corpus="gsm8k", num_traces=1000), 0.9)
    assert [p for p, _ in skill] == [p for p, _ in episodes]  # same problems, different decisions
    assert 0.85 < sum(len(turns) == 2 for _, turns in skill) / len(skill) < 0.95
    for prompt, turns in episodes[:50]:
        if len(turns) == 2:  # calculator result copied into the final answer
            assert json.loads(turns[1][0][len("<tool_call>"):-len("</tool_call>")])["arguments"]["answer"] == turns[0][1][0]["content"]


# ---- pre-training, cache, harness ----------------------------------------------------------------------

def test_micro_pretraining_cache_and_reload(tmp_path: Path) -> None:
    stale = tiny_base_path(tmp_path, MICRO).parent / f".tmp-{tiny_base_path(tmp_path, MICRO).name}-999999"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # left by a build that was killed
    path = ensure_tiny_base(tmp_path, MICRO)
    assert path == tiny_base_path(tmp_path, MICRO) and path.name == f"tiny-qwen3-{MICRO.cache_key()}"
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "recipe.json"]:
        assert (path / name).is_file(), name
    assert not list(path.parent.glob(".tmp-*"))
    record = json.loads((path / "recipe.json").read_text())
    assert record["final_loss"] < record["first_loss"] * 0.8 and record["recipe"]["steps"] == MICRO.steps
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert isinstance(model, Qwen3ForCausalLM) and model.config.hidden_size == 32 and model.config.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) \
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_base(tmp_path, MICRO) == path and (path / "model.safetensors").stat().st_mtime_ns == mtime

    result = evaluate_policy(model, tok, make_dataset_rows(6, seed=0, split="test"), max_new_tokens=8, batch_size=4)
    assert result.episodes == 6 and 0.0 <= result.accuracy <= 1.0 and 0.0 <= result.calculator_rate <= 1.0
    assert result.mean_episode_tokens > result.mean_generated_tokens > 0


def test_crashed_build_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = TinyBaseRecipe(**{**MICRO.__dict__, "seed": 1})

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated crash while saving")

    # The model weights are already written into the temporary directory when the tokenizer save fails.
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_tiny_base(tmp_path, recipe)
    models = tmp_path / "models"
    assert not tiny_base_path(tmp_path, recipe).exists()
    assert not [p for p in models.iterdir() if not p.name.endswith(".lock")]


def test_recipe_key_covers_settings_and_validates() -> None:
    assert TinyBaseRecipe(corpus="gsm8k").cache_key() == TinyBaseRecipe(corpus="gsm8k").cache_key()
    assert TinyBaseRecipe(corpus="gsm8k", steps=599).cache_key() != TinyBaseRecipe(corpus="gsm8k").cache_key()
    assert TinyBaseRecipe(corpus="gsm8k", solve_rate=0.5).cache_key() != TinyBaseRecipe(corpus="gsm8k").cache_key()
    with pytest.raises(ValueError):
        TinyBaseRecipe(corpus="gsm8k", solve_rate=1.5)
    with pytest.raises(ValueError):
        TinyBaseRecipe(corpus="gsm8k", steps=0)
    with pytest.raises(ValueError):
        TinyBaseRecipe(corpus="gsm8k", steps=50, prior_steps=60)


def test_the_corpus_is_a_recipe_that_offers_one() -> None:
    assert TinyBaseRecipe(corpus="gsm8k").cache_key() != TinyBaseRecipe(corpus="taubench").cache_key()
    for name in ("taubench", "nope"):
        with pytest.raises(ConfigError, match=f"model.corpus={name} is no recipe with a pre-training corpus; use one of gsm8k"):
            pretraining_episodes(TinyBaseRecipe(corpus=name), 0.5)
