"""Tests of ``skyrl_clora.recipes.gsm8k.evaluate``: ``evaluate_policy`` plays one ``gsm8k_calc`` episode per row
with the model's sampled turns (each cut at its first end-of-turn token), in batches, feeding tool observations
back as SkyRL's generator does, and reports accuracy, calculator use, malformed turns and token counts. The model
here is a scripted stand-in whose turns are fixed per question, so every rate and count is known exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from skyrl_clora.recipes.gsm8k.evaluate import evaluate_policy
from skyrl_clora.recipes.gsm8k.problems import make_dataset_rows
from skyrl_clora.recipes.gsm8k.tools import format_tool_call
from skyrl_clora.tiny_base.tokenizer import episode_token_ids


class ScriptedModel:
    """Answers ``generate`` with the next turn of the script of the question in each prompt (the turn number is the
    number of tool responses the prompt holds), followed by the end-of-turn token and tokens past it that must be
    cut off; records the keyword arguments of every call."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, scripts: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.calls: list[dict] = []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
        self.calls.append({"batch": len(input_ids), **kwargs})
        outputs = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([i for i, m in zip(ids, mask) if m])
            question = next(q for q in self.scripts if q in prompt)
            turn = self.scripts[question][prompt.count("<tool_response>")]
            outputs.append(self.tokenizer.encode(turn, add_special_tokens=False) + [kwargs["eos_token_id"]]
                           + self.tokenizer.encode(" junk", add_special_tokens=False))
        width = max(len(out) for out in outputs)
        new = [out + [kwargs["pad_token_id"]] * (width - len(out)) for out in outputs]
        return torch.cat([input_ids, torch.tensor(new)], dim=1)


@pytest.fixture(scope="module")
def tokenizer(micro_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(micro_model_dir)


def _final(answer: int | str) -> str:
    return format_tool_call("final_answer", {"answer": str(answer)})


def test_rates_and_token_counts_of_scripted_episodes(tokenizer: PreTrainedTokenizerBase) -> None:
    rows = make_dataset_rows(4, seed=0)
    truths = [int(row["reward_spec"]["ground_truth"]) for row in rows]
    expression = rows[0]["extra_info"]["answer"].split(" = ")[0]
    calculator = format_tool_call("calculator", {"expression": expression})
    scripts = {
        rows[0]["extra_info"]["question"]: [calculator, _final(truths[0])],
        rows[1]["extra_info"]["question"]: [_final(truths[1])],
        rows[2]["extra_info"]["question"]: ["I do not know."],
        rows[3]["extra_info"]["question"]: [_final(truths[3] + 1)],
    }
    model = ScriptedModel(tokenizer, scripts)
    result = evaluate_policy(model, tokenizer, rows, max_new_tokens=33, temperature=0.7, batch_size=3)
    assert (result.episodes, result.accuracy, result.calculator_rate) == (4, 0.5, 0.25)
    assert (result.accuracy_with_calculator, result.accuracy_without_calculator) == (1.0, pytest.approx(1 / 3))
    assert result.malformed_rate == 0.25 and result.seconds >= 0
    # What it counts is what SkyRL's generator assembles for the same turns (observations between them).
    episodes = []
    for row, script in zip(rows, scripts.values()):
        turns = [(text, [{"role": "tool", "content": str(truths[0])}]) for text in script]
        episodes.append(episode_token_ids(tokenizer, row["prompt"], turns)[0])
    generated = sum(len(tokenizer.encode(text, add_special_tokens=False)) + 1 for s in scripts.values() for text in s)
    assert result.mean_generated_tokens == generated / 4
    assert result.mean_episode_tokens == sum(len(ids) for ids in episodes) / 4
    # Batches of at most 3 prompts; the second round holds only the episode still running.
    assert [call["batch"] for call in model.calls] == [3, 1, 1]
    assert all((call["max_new_tokens"], call["temperature"], call["do_sample"]) == (33, 0.7, True)
               for call in model.calls)


def test_no_rows_gives_undefined_rates(tokenizer: PreTrainedTokenizerBase) -> None:
    result = evaluate_policy(ScriptedModel(tokenizer, {}), tokenizer, [])
    assert result.episodes == 0 and math.isnan(result.accuracy) and math.isnan(result.mean_episode_tokens)
    assert math.isnan(result.accuracy_with_calculator) and math.isnan(result.malformed_rate)
