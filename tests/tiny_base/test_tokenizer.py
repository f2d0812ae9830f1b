"""The tiny base's tokenizer (:mod:`skyrl_clora.tiny_base.tokenizer`): Qwen's special tokens and single-token tool
tags, lossless round trips, digits split one per token, the Qwen-style chat template, observation ids as SkyRL's
generator appends them, and an episode assembled token for token as SkyRL's own agent loop produces it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from transformers import PreTrainedTokenizerFast

from skyrl_clora.recipes.gsm8k import make_dataset_rows, register_gsm8k_env
from skyrl_clora.recipes.gsm8k.tools import format_tool_call
from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, build_tokenizer, pretraining_episodes
from skyrl_clora.tiny_base.tokenizer import (CHAT_TEMPLATE, TOOL_TOKENS, episode_token_ids, observation_ids,
                                             template_ids, train_tokenizer)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer(pretraining_episodes(TinyBaseRecipe(corpus="gsm8k", num_traces=400), 0.5), vocab_size=1024)


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


def test_a_trained_tokenizer_puts_the_tool_tags_last_and_stops_when_merges_run_out() -> None:
    corpus = ["abc abd <tool_call>x</tool_call> 12 <|im_end|>"] * 5
    small = train_tokenizer(corpus, vocab_size=300)
    assert small.convert_tokens_to_ids(list(TOOL_TOKENS)) == list(range(len(small) - 4, len(small)))
    assert small.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert len(small) - 4 < 300, "a corpus with few merges gives fewer tokens than asked for"
    assert small.chat_template == CHAT_TEMPLATE and small.model_max_length == 2048
    assert small.decode(small.encode("abd 12", add_special_tokens=False)) == "abd 12"
