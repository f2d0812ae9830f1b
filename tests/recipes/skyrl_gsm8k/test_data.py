"""Tests of ``skyrl_clora.recipes.skyrl_gsm8k.data``: rows in the columns SkyRL's gsm8k_dataset.py writes (the
question plus SkyRL's ``####`` instruction as the one user message, env ``gsm8k``, the answer as the rule's ground
truth), deterministic in their keys; such parquet files read back unchanged, a row without a ground truth or a chat
prompt refused by its number; and the ``train.parquet`` / ``validation.parquet`` pair written as SkyRL's script
writes it, from Python or the command line."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from skyrl_clora.recipes.gsm8k.problems import GSM8K_INSTRUCTION, generate_problems
from skyrl_clora.recipes.skyrl_gsm8k.data import (
    load_skyrl_parquet,
    main,
    make_skyrl_rows,
    problem_to_skyrl_row,
    user_message,
    write_skyrl_gsm8k,
)


def test_a_row_has_skyrls_gsm8k_columns() -> None:
    problem = generate_problems(1, seed=0)[0]
    row = problem_to_skyrl_row(problem, "test", 5)
    assert row == {
        "data_source": "synthetic_gsm8k",
        "prompt": [{"role": "user", "content": f"{problem.question} {GSM8K_INSTRUCTION}"}],
        "env_class": "gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": "test", "index": 5, "answer": problem.answer_text, "question": problem.question},
    }
    assert user_message("Q?") == "Q? Let's think step by step and output the final answer after \"####\"."


def test_rows_are_deterministic_in_their_keys() -> None:
    rows = make_skyrl_rows(6, seed=2, variant="hard", split="train")
    assert rows == make_skyrl_rows(6, seed=2, variant="hard", split="train")
    assert rows != make_skyrl_rows(6, seed=3, variant="hard", split="train")
    assert [row["extra_info"]["index"] for row in rows] == list(range(6))
    questions = [p.question for p in generate_problems(6, seed=2, variant="hard", split="train")]
    assert [row["extra_info"]["question"] for row in rows] == questions


def test_written_files_read_back_unchanged(tmp_path: Path) -> None:
    train, val = write_skyrl_gsm8k(tmp_path / "gsm8k", train_size=5, val_size=3, seed=1, variant="easy")
    assert (train, val) == (tmp_path / "gsm8k" / "train.parquet", tmp_path / "gsm8k" / "validation.parquet")
    assert load_skyrl_parquet(train) == make_skyrl_rows(5, seed=1, variant="easy", split="train")
    assert load_skyrl_parquet(val) == make_skyrl_rows(3, seed=1, variant="easy", split="test")


def test_rows_without_a_ground_truth_or_a_prompt_are_refused(tmp_path: Path) -> None:
    rows = make_skyrl_rows(3, seed=0)
    rows[2]["reward_spec"] = {"method": "rule", "ground_truth": None}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "no_truth.parquet")
    with pytest.raises(ValueError, match=r"^row 2 has no reward_spec\.ground_truth$"):
        load_skyrl_parquet(tmp_path / "no_truth.parquet")
    rows = make_skyrl_rows(2, seed=0)
    rows[1]["prompt"] = []
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "no_prompt.parquet")
    with pytest.raises(ValueError, match="row 1 has no chat prompt"):
        load_skyrl_parquet(tmp_path / "no_prompt.parquet")
    with pytest.raises(FileNotFoundError):
        load_skyrl_parquet(tmp_path / "missing.parquet")


def test_the_command_line_writes_both_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    main(["--output_dir", str(tmp_path / "out"), "--train_size", "4", "--val_size", "2", "--seed", "7"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "out" / "train.parquet"),
                                               str(tmp_path / "out" / "validation.parquet")]
    assert load_skyrl_parquet(tmp_path / "out" / "validation.parquet") == make_skyrl_rows(2, seed=7, split="test")
    with pytest.raises(SystemExit):
        main(["--variant", "impossible"])
