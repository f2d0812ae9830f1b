"""Tests of ``skyrl_clora.recipes.gsm8k.env``: the ``gsm8k_calc`` skyrl-gym environment's episode rules (a
calculator call answered as a tool observation, a final answer scored against the ground truth, a malformed turn or
the last turn ending the episode at reward 0), its metrics, its settings, and its registration with skyrl-gym."""

from __future__ import annotations

import pytest
import skyrl_gym

from skyrl_clora.recipes.gsm8k import GSM8KCalcEnv, register_gsm8k_env
from skyrl_clora.recipes.gsm8k.tools import format_tool_call
from tests.support.gsm8k_tool_calls import calculator_call as _calc
from tests.support.gsm8k_tool_calls import final_answer_call as _final


def _env(ground_truth: str = "91", max_turns: int = 3) -> GSM8KCalcEnv:
    return GSM8KCalcEnv({}, {"reward_spec": {"method": "rule", "ground_truth": ground_truth}, "max_turns": max_turns})


def test_calculator_then_correct_final_answer() -> None:
    env = _env("91")
    prompt, _ = env.init([{"role": "user", "content": "q"}])
    assert prompt == [{"role": "user", "content": "q"}]
    first = env.step(_calc("23+4*17") + "<|im_end|>")
    assert first["done"] is False and first["reward"] == 0.0
    assert first["observations"] == [{"role": "tool", "content": "91"}]
    second = env.step(_final("91"))
    assert second["done"] is True and second["reward"] == 1.0 and second["observations"] == []
    assert env.get_metrics() == {"used_calculator": 1, "turns": 2, "correct": 1, "malformed": 0}


def test_wrong_and_direct_answers() -> None:
    wrong = _env("91")
    out = wrong.step(_final("90"))
    assert out["done"] and out["reward"] == 0.0
    assert wrong.get_metrics() == {"used_calculator": 0, "turns": 1, "correct": 0, "malformed": 0}
    direct = _env("91")
    assert direct.step(_final("91.0"))["reward"] == 1.0
    numeric = _env("91")
    assert numeric.step('<tool_call>{"name": "final_answer", "arguments": {"answer": 91}}</tool_call>')["reward"] == 1.0


@pytest.mark.parametrize("action", [
    "The answer is 91.", "<tool_call>{not json}</tool_call>", format_tool_call("search", {"query": "91"}),
    "#### 91", "",
])
def test_malformed_turn_ends_episode_with_zero_reward(action: str) -> None:
    env = _env("91")
    out = env.step(action)
    assert out["done"] is True and out["reward"] == 0.0 and out["observations"] == []
    assert env.get_metrics()["malformed"] == 1 and env.get_metrics()["correct"] == 0


def test_calculator_error_is_an_observation() -> None:
    env = _env("91")
    out = env.step(_calc("__import__('os')"))
    assert out["done"] is False and out["observations"][0]["content"].startswith("error:")
    assert env.step(_final("91"))["reward"] == 1.0


def test_max_turns_ends_episode_with_zero_reward() -> None:
    env = _env("91", max_turns=2)
    assert env.step(_calc("1+1"))["done"] is False
    out = env.step(_calc("23+4*17"))
    assert out["done"] is True and out["reward"] == 0.0 and out["observations"] == []
    assert env.get_metrics() == {"used_calculator": 1, "turns": 2, "correct": 0, "malformed": 0}


def test_env_needs_ground_truth_and_reads_max_turns_from_extra_info() -> None:
    with pytest.raises(ValueError, match="ground_truth"):
        GSM8KCalcEnv({}, {"reward_spec": {}})
    env = GSM8KCalcEnv({}, {"reward_spec": {"ground_truth": "1"}, "extra_info": {"max_turns": 1}})
    assert env.max_turns == 1 and env.step(_calc("1"))["done"] is True


def test_registration_is_idempotent_and_make_builds_the_env() -> None:
    assert register_gsm8k_env() == "gsm8k_calc"
    assert register_gsm8k_env() == "gsm8k_calc"
    env = skyrl_gym.make("gsm8k_calc", env_config={}, extras={"reward_spec": {"ground_truth": "4"}, "max_turns": 2})
    assert isinstance(env, GSM8KCalcEnv) and env.max_turns == 2
    assert env.step(_final("4"))["reward"] == 1.0


def test_max_turns_below_one_is_refused_and_metadata_names_the_tool() -> None:
    with pytest.raises(ValueError, match="max_turns must be >= 1, got 0"):
        _env("91", max_turns=0)
    env = _env("91")
    assert env.step(_calc("1+1"))["metadata"] == {"tool": "calculator"}
    assert env.step(format_tool_call("search", {}))["metadata"] == {"tool": "search"}
    assert _env("91").step("no call")["metadata"] == {"tool": None}
