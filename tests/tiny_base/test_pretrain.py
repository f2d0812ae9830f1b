"""The embedded tiny base: tokenizer, chat template vs SkyRL's generator, micro pre-training, cache, eval harness."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

from skyrl_clora.recipes.gsm8k import make_dataset_rows, register_gsm8k_env
from skyrl_clora.recipes.gsm8k.tools import format_tool_call
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.recipes.gsm8k.evaluate import evaluate_policy
from skyrl_clora.tiny_base.pretrain import (
    TinyBaseRecipe,
    build_tokenizer,
    ensure_tiny_base,
    pretraining_episodes,
    tiny_base_path,
)
from skyrl_clora.tiny_base.tokenizer import TOOL_TOKENS, episode_token_ids, observation_ids, template_ids

MICRO = TinyBaseRecipe(corpus="gsm8k", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, num_traces=64, steps=12, prior_steps=4, batch_size=8, lr=1e-2, warmup_steps=2)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer(pretraining_episodes(TinyBaseRecipe(corpus="gsm8k", num_traces=400), 0.5), vocab_size=1024)


# ---- tokenizer --------------------------------------------------------------------------------------------

def test_special_tokens_and_vocab(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert 300 <= len(tokenizer) <= 2048
    for tag in TOOL_TOKENS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    call = format_tool_call("calculator", {"expression": "23+4*17"})
    ids = tokenizer.encode(call + "<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == call  # tool tags survive, eos does not
    assert len(ids) <= 25  # turns stay short: every token is decoded on a CPU


@pytest.mark.parametrize("text", [
    "Tom has 23 apples. He buys 4 bags with 17 apples each. How many apples does he have now?",
    "Janet’s ducks lay 16 eggs per day; she sells the remainder at $2 per egg.\n\nÜber café 1,234.5 ✓",
    "  leading spaces and trailing  ",
])
def test_round_trip(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_digits_are_split_individually(tokenizer: PreTrainedTokenizerFast) -> None:
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("12345 and 987", add_special_tokens=False))
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["1", "2", "3", "4", "5", "9", "8", "7"]


def test_chat_template_renders_roles_and_generation_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}, {"role": "tool", "content": "91"},
                {"role": "tool", "content": "7"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n91\n</tool_response>\n<tool_response>\n7\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(ids, list) and tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_observation_ids_start_after_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    obs = observation_ids(tokenizer, [{"role": "tool", "content": "91"}], is_done=False)
    assert tokenizer.decode(obs) == "\n<|im_start|>user\n<tool_response>\n91\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert observation_ids(tokenizer, [], is_done=True) == []
    assert tokenizer.decode(observation_ids(tokenizer, [], is_done=False)) == "<|im_start|>assistant\n"


class _ScriptedEngine:
    """InferenceEngineInterface stand-in for SkyRLGymGenerator: replays fixed assistant turns (with eos)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def generate(self, engine_input: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        self.prompts.append(list(engine_input["prompt_token_ids"][0]))
        text = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return {"responses": [text], "response_ids": [ids], "stop_reasons": ["stop"], "response_logprobs": None}

    async def finish_session(self, session_id: str) -> None:
        return None


def test_skyrl_generator_episode_equals_whole_conversation_render(tokenizer: PreTrainedTokenizerFast) -> None:
    """SkyRL's own agent loop (token-in-token-out) must produce what templating the whole conversation gives."""
    register_gsm8k_env()
    row = make_dataset_rows(1, seed=0)[0]
    truth = row["reward_spec"]["ground_truth"]
    expression = row["extra_info"]["answer"].split(" = ")[0]
    turns = [format_tool_call("calculator", {"expression": expression}), format_tool_call("final_answer", {"answer": truth})]
    engine = _ScriptedEngine(tokenizer, turns)
    generator = SkyRLGymGenerator(GeneratorConfig(max_turns=3), SkyRLGymConfig(max_env_workers=0), engine, tokenizer)
    out = asyncio.run(generator.agent_loop(row["prompt"], "gsm8k_calc", {"reward_spec": row["reward_spec"]},
                                           max_tokens=64, max_input_length=1024))
    conversation = [*row["prompt"], {"role": "assistant", "content": turns[0]}, {"role": "tool", "content": truth},
                    {"role": "assistant", "content": turns[1]}]
    whole = template_ids(tokenizer, conversation, add_generation_prompt=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert whole[-1:] == newline  # the template's newline after the final <|im_end|> is never generated
    assert out.prompt_ids + out.response_ids == whole[:-1]
    assert out.prompt_ids == template_ids(tokenizer, row["prompt"], add_generation_prompt=True)
    assert engine.prompts[1] == whole[: len(engine.prompts[1])]
    ids, mask = episode_token_ids(tokenizer, row["prompt"], [(turns[0], [{"role": "tool", "content": truth}]), (turns[1], [])])
    assert ids == whole[:-1] and mask[len(out.prompt_ids):] == out.loss_mask
    assert sum(out.reward) == 1.0 and out.env_metrics["used_calculator"] == 1 and out.env_metrics["correct"] == 1
    masked_text = tokenizer.decode([t for t, m in zip(out.response_ids, out.loss_mask) if m])
    assert masked_text == turns[0] + "<|im_end|>" + turns[1] + "<|im_end|>"


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
