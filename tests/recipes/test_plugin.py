"""Prompts longer than ``trainer.max_prompt_length`` are dropped at load, as SkyRL's ``PromptDataset`` drops them:
counted with the chat template and generation prompt, training and evaluation rows alike, with a log line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.main import main
from skyrl_clora.recipes.plugin import TaskSource, drop_long_prompts
from skyrl_clora.recipes.skyrl_gsm8k.data import make_skyrl_rows, save_rows_parquet


def _rows(count: int, long_rows: tuple[int, ...], split: str = "train") -> list[dict]:
    """SkyRL-format GSM8K rows; those in ``long_rows`` with a question 40 times as long."""
    rows = make_skyrl_rows(count, seed=0, split=split)
    for index in long_rows:
        message = rows[index]["prompt"][-1]
        rows[index]["prompt"] = [*rows[index]["prompt"][:-1], {**message, "content": message["content"] * 40}]
    return rows


def _length(tokenizer, row: dict) -> int:
    return len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))


def test_rows_over_the_limit_go_and_the_rest_stay(micro_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = AutoTokenizer.from_pretrained(micro_model_dir)
    train, evaluation = _rows(4, long_rows=(1,)), _rows(3, long_rows=(0, 2), split="test")
    limit = max(_length(tokenizer, row) for row in train if row is not train[1])  # a row of exactly the limit stays
    assert _length(tokenizer, train[1]) > limit
    source = TaskSource("gsm8k", train, evaluation, seed=0)
    with caplog.at_level(logging.WARNING, logger="skyrl_clora"):
        kept = drop_long_prompts(source, tokenizer, limit, "tenant-0")
    assert kept.train_rows == [train[0], train[2], train[3]] and kept.eval_rows == [evaluation[1]]
    assert source.train_rows == train  # the source given is unchanged
    assert "tenant tenant-0: dropped 1 of 4 training rows" in caplog.text
    assert "dropped 2 of 3 evaluation rows" in caplog.text
    with pytest.raises(ConfigError, match="every training prompt is longer than trainer.max_prompt_length=5 tokens"):
        drop_long_prompts(source, tokenizer, 5, "tenant-0")


@pytest.mark.e2e
def test_a_run_plans_its_steps_on_the_rows_left(micro_model_dir: Path, tmp_path: Path) -> None:
    """4 rows, one too long: SkyRL's step count is 3 // train_batch_size=2 = 1 RL step, not 2."""
    tokenizer = AutoTokenizer.from_pretrained(micro_model_dir)
    train = _rows(4, long_rows=(2,))
    limit = max(_length(tokenizer, row) for i, row in enumerate(train) if i != 2)
    save_rows_parquet(train, tmp_path / "train.parquet")
    save_rows_parquet(_rows(2, long_rows=(), split="test"), tmp_path / "validation.parquet")
    out = tmp_path / "run"
    assert main([
        f"trainer.policy.model.path={micro_model_dir}", "preset=demo", f"clora.output_dir={out}", "clora.progress=false",
        "environment.env_class=gsm8k", f"data.train_data=['{tmp_path}/train.parquet']",
        f"data.val_data=['{tmp_path}/validation.parquet']", f"trainer.max_prompt_length={limit}",
        "generator.max_input_length=2048", "trainer.max_training_steps=null", "trainer.train_batch_size=2",
        "generator.n_samples_per_prompt=2", "trainer.eval_interval=0", "generator.sampling_params.max_generate_length=4",
    ]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1
