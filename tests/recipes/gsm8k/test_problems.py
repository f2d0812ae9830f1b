"""Tests of ``skyrl_clora.recipes.gsm8k.problems``: the word-problem generator (deterministic in its keys, answers
that match their expressions, the variants' difficulty), the SkyRL-format dataset rows it makes, and real GSM8K
parquet files (SkyRL's gsm8k_dataset.py rows) mapped to the agentic calculator task and round-tripped through
parquet."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skyrl_clora.recipes.gsm8k import (
    ENV_CLASS,
    SYSTEM_PROMPT,
    GSM8KCalcEnv,
    generate_problems,
    load_gsm8k_parquet,
    make_dataset_rows,
    save_rows_parquet,
)
from skyrl_clora.recipes.gsm8k.problems import GSM8K_INSTRUCTION, gsm8k_row_to_agentic
from skyrl_clora.recipes.gsm8k.tools import calculate
from tests.support.gsm8k_tool_calls import final_answer_call as _final


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


def test_easy_variant_is_one_single_digit_sum_or_difference() -> None:
    problems = generate_problems(60, seed=5, variant="easy")
    assert {len(re.findall(r"[-+]", p.expression)) for p in problems} == {1}
    assert all(int(n) <= 9 for p in problems for n in re.findall(r"\d+", p.expression))
    assert {p.expression[1] for p in problems} == {"+", "-"} and all(1 <= p.answer <= 18 for p in problems)
    assert generate_problems(0, variant="easy") == []


def test_a_gsm8k_row_maps_with_defaults_for_what_it_lacks() -> None:
    row = {"prompt": [{"role": "system", "content": "s"},
                      {"role": "user", "content": "How many? " + GSM8K_INSTRUCTION}],
           "reward_spec": {"ground_truth": 12}}
    mapped = gsm8k_row_to_agentic(row, 7)
    assert mapped["prompt"] == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "How many?"}]
    assert mapped["data_source"] == "openai/gsm8k" and mapped["env_class"] == ENV_CLASS
    assert mapped["reward_spec"] == {"method": "rule", "ground_truth": "12"}
    assert mapped["extra_info"] == {"split": "train", "index": 7, "answer": "#### 12", "question": "How many?"}


def test_a_gsm8k_row_without_ground_truth_or_question_is_refused() -> None:
    with pytest.raises(ValueError, match="row 3 has no reward_spec.ground_truth"):
        gsm8k_row_to_agentic({"prompt": [{"role": "user", "content": "q"}], "reward_spec": {}}, 3)
    with pytest.raises(ValueError, match=r"row 4 has no user message and no extra_info\.question"):
        gsm8k_row_to_agentic({"prompt": [{"role": "system", "content": "s"}], "reward_spec": {"ground_truth": "1"},
                              "extra_info": {"index": 4}}, 0)
