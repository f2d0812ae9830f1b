"""The GSM8K-format task: problem generator, safe calculator, tool-call parsing, the env, parquet loading."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import skyrl_gym

from skyrl_clora.recipes.gsm8k import (
    ENV_CLASS,
    SYSTEM_PROMPT,
    GSM8KCalcEnv,
    generate_problems,
    load_gsm8k_parquet,
    make_dataset_rows,
    register_gsm8k_env,
    save_rows_parquet,
)
from skyrl_clora.recipes.gsm8k.problems import GSM8K_INSTRUCTION
from skyrl_clora.recipes.gsm8k.tools import (
    CalculatorError,
    ToolCallError,
    calculate,
    format_tool_call,
    numbers_equal,
    parse_tool_call,
)


def _calc(expression: str) -> str:
    return format_tool_call("calculator", {"expression": expression})


def _final(answer: str) -> str:
    return format_tool_call("final_answer", {"answer": answer})


def _env(ground_truth: str = "91", max_turns: int = 3) -> GSM8KCalcEnv:
    return GSM8KCalcEnv({}, {"reward_spec": {"method": "rule", "ground_truth": ground_truth}, "max_turns": max_turns})


# ---- problem generator ---------------------------------------------------------------------------------

def test_generation_is_deterministic_and_depends_on_every_key() -> None:
    base = generate_problems(40, seed=3, variant="standard", split="train")
    assert base == generate_problems(40, seed=3, variant="standard", split="train")
    assert base != generate_problems(40, seed=4, variant="standard", split="train")
    assert base != generate_problems(40, seed=3, variant="standard", split="test")
    assert generate_problems(10, seed=3, variant="standard", split="train") == base[:10]  # stable prefixes


@pytest.mark.parametrize("variant", ["standard", "hard"])
def test_answers_match_expressions(variant: str) -> None:
    for problem in generate_problems(200, seed=0, variant=variant):
        assert calculate(problem.expression) == str(problem.answer)
        assert problem.answer > 0
        assert problem.answer_text.endswith(f"#### {problem.answer}")
        # Numbers appear in the question in the order the expression uses them.
        assert re.findall(r"\d+", problem.question) == re.findall(r"\d+", problem.expression), problem


def test_hard_variant_has_more_operations_and_bigger_numbers() -> None:
    def stats(variant: str) -> tuple[float, int]:
        problems = generate_problems(300, seed=0, variant=variant)
        ops = sum(len(re.findall(r"[-+*/]", p.expression)) for p in problems) / len(problems)
        return ops, max(int(n) for p in problems for n in re.findall(r"\d+", p.expression))

    standard_ops, standard_max = stats("standard")
    hard_ops, hard_max = stats("hard")
    assert 1.0 <= standard_ops < hard_ops and hard_ops >= 3.0
    assert hard_max > standard_max


def test_unknown_variant_and_negative_count_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown gsm8k task variant"):
        generate_problems(3, variant="impossible")
    with pytest.raises(ValueError):
        generate_problems(-1)


def test_dataset_rows_have_skyrl_format() -> None:
    rows = make_dataset_rows(5, seed=1, variant="hard", split="test")
    assert rows == make_dataset_rows(5, seed=1, variant="hard", split="test")
    for index, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "env_class", "reward_spec", "extra_info"}
        assert row["data_source"] == "synthetic_gsm8k" and row["env_class"] == ENV_CLASS == "gsm8k_calc"
        assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert row["prompt"][1]["role"] == "user"
        assert row["prompt"][1]["content"] == row["extra_info"]["question"]
        assert row["reward_spec"]["method"] == "rule"
        assert row["extra_info"]["answer"].endswith("#### " + row["reward_spec"]["ground_truth"])
        assert row["extra_info"]["split"] == "test" and row["extra_info"]["index"] == index


# ---- calculator and tool calls ----------------------------------------------------------------------

@pytest.mark.parametrize("expression, expected", [
    ("4*17+23", "91"), ("(12 + 8) / 5", "4"), ("7/2", "3.5"), ("-3+1.5", "-1.5"), ("2**10", "1024"),
    ("10/3", "3.333333"), ("((2))", "2"),
])
def test_calculator_values(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "x + 1", "(1).real", "abs(-1)", "'a' * 3", "True + 1", "[1, 2]",
    "9**9**9", "10**100", "2**0.5", "1/0", "0**-1", "1 if 1 else 2", "lambda: 1", "1; 2", "", "1e300*1e300",
    "9" * 30, "1+" * 150 + "1", "3 % 2", "7 // 2",
])
def test_calculator_rejects_unsafe_or_huge_input(expression: str) -> None:
    with pytest.raises(CalculatorError):
        calculate(expression)


def test_parse_tool_call_accepts_spaced_and_compact_json() -> None:
    spaced = 'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "4*17+23"}}</tool_call>'
    call = parse_tool_call(spaced)
    assert call is not None and call.name == "calculator" and call.arguments == {"expression": "4*17+23"}
    compact = parse_tool_call(_final("91") + _calc("1+1"))  # the first call wins
    assert compact is not None and compact.name == "final_answer" and compact.arguments == {"answer": "91"}
    assert parse_tool_call("the answer is 91") is None
    assert parse_tool_call('<tool_call>{"name": "calculator"') is None  # never closed
    for bad in ['<tool_call>{"name": calculator}</tool_call>', "<tool_call>[1]</tool_call>",
                '<tool_call>{"name": "x", "arguments": [1]}</tool_call>']:
        with pytest.raises(ToolCallError):
            parse_tool_call(bad)


def test_numbers_equal() -> None:
    assert numbers_equal("91", "91") and numbers_equal("91.0", "91") and numbers_equal("1,234", "1234")
    assert numbers_equal("$5", "5") and numbers_equal(" 2.50 ", "2.5")
    assert not numbers_equal("90", "91") and not numbers_equal("ninety", "91") and not numbers_equal("", "0")


# ---- environment ------------------------------------------------------------------------------------

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


# ---- real GSM8K parquet files -------------------------------------------------------------------------

def _skyrl_gsm8k_row(index: int, question: str, answer: int, with_question: bool) -> dict:
    """One row as SkyRL's examples gsm8k_dataset.py writes it."""
    extra_info = {"split": "test", "index": index, "answer": f"Some steps.\n#### {answer}"}
    if with_question:
        extra_info["question"] = question
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "env_class": "gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": str(answer)},
        "extra_info": extra_info,
    }


def test_load_gsm8k_parquet_maps_rows_to_agentic_format(tmp_path: Path) -> None:
    questions = ["Natalia sold clips to 48 of her friends in April. How many clips?", "A robe takes 2 bolts. Total?"]
    rows = [_skyrl_gsm8k_row(0, questions[0], 72, with_question=True),
            _skyrl_gsm8k_row(1, questions[1], 3, with_question=False)]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = load_gsm8k_parquet(path)
    assert [r["prompt"][1]["content"] for r in loaded] == questions
    assert [r["reward_spec"]["ground_truth"] for r in loaded] == ["72", "3"]
    for row, original in zip(loaded, rows):
        assert row["env_class"] == "gsm8k_calc" and row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert row["extra_info"]["answer"] == original["extra_info"]["answer"]
        assert row["extra_info"]["index"] == original["extra_info"]["index"]
        assert row["data_source"] == "openai/gsm8k"
    env = GSM8KCalcEnv({}, {"reward_spec": loaded[0]["reward_spec"], "max_turns": 2})
    assert env.step(_final("72"))["reward"] == 1.0


def test_generated_rows_round_trip_through_parquet(tmp_path: Path) -> None:
    rows = make_dataset_rows(4, seed=0)
    path = save_rows_parquet(rows, tmp_path / "sub" / "train.parquet")
    assert load_gsm8k_parquet(path) == rows
    with pytest.raises(FileNotFoundError):
        load_gsm8k_parquet(tmp_path / "missing.parquet")
