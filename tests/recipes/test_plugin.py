"""Tests of ``skyrl_clora.recipes.plugin``: the recipes found beside it and the one serving an env class (else the
catch-all for a registered env, else a config error listing them), training rows drawn per step without replacement
in a seeded order per epoch, a row run in the env SkyRL's rule gives it (the tenant's override, else the row's own
``env_class``, else the run's), every tenant's data built up front with bad data or an unregistered env a one-line
config error; and prompts longer than ``trainer.max_prompt_length`` dropped at load, as SkyRL's ``PromptDataset``
drops them: counted with the chat template and generation prompt, training and evaluation rows alike, with a log
line."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import skyrl_gym
from transformers import AutoTokenizer

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.main import main
from skyrl_clora.recipes.gsm8k.recipe import RECIPE as GSM8K_RECIPE
from skyrl_clora.recipes.plugin import (
    TaskSource,
    build_task_sources,
    drop_long_prompts,
    load_corpus,
    load_recipe,
    read_parquet_files,
    recipe_folders,
    recipe_for_env,
)
from skyrl_clora.recipes.skyrl_gsm8k.data import make_skyrl_rows, save_rows_parquet
from tests.support.recipe_runs import run_config


MULTIPLY = "multiply"


def test_a_rows_env_class_is_honoured_as_skyrl_honours_it() -> None:
    """SkyRL's rule (``prepare_generator_input``): the row's ``env_class`` when it has one, else the run's; a
    tenant's ``env_class`` override (the plugin's per-tenant key) runs every row of the tenant in its env."""
    rows = [{"prompt": [{"role": "user", "content": "a"}], "env_class": MULTIPLY},
            {"prompt": [{"role": "user", "content": "b"}], "env_class": None},
            {"prompt": [{"role": "user", "content": "c"}]}]
    source = TaskSource("aime", rows, rows, seed=0)
    assert [row["env_class"] for row in source.evaluation_rows()] == [MULTIPLY, "aime", "aime"]
    assert source.env_classes() == {MULTIPLY, "aime"}
    overridden = TaskSource("aime", rows, rows, seed=0, tenant_env_class="gsm8k")
    assert [row["env_class"] for row in overridden.step_rows(0, 3)] == ["gsm8k"] * 3


def test_recipes_are_found_and_chosen_by_env_class() -> None:
    assert recipe_folders() == ["gsm8k", "skyrl_gsm8k", "skyrl_gym_env", "taubench"]
    assert load_recipe("gsm8k") is GSM8K_RECIPE
    with pytest.raises(ConfigError,
                       match="recipe=nope is unknown; use one of gsm8k, skyrl_gsm8k, skyrl_gym_env, taubench"):
        load_recipe("nope")
    assert [recipe_for_env(env) for env in ("gsm8k_calc", "gsm8k", "taubench_retail", "aime")] == [
        "gsm8k", "skyrl_gsm8k", "taubench", "skyrl_gym_env"]
    with pytest.raises(ConfigError, match=r"environment.env_class=nope has no recipe here .* use one of "
                                          r"gsm8k \(skyrl_gsm8k\), gsm8k_calc \(gsm8k\), taubench_retail \(taubench\), "
                                          r"or an env"):
        recipe_for_env("nope")
    assert load_corpus("skyrl_gsm8k") is load_recipe("skyrl_gsm8k")
    with pytest.raises(ConfigError, match="model.corpus=taubench is no recipe with a pre-training corpus; use one of "
                                          "gsm8k, skyrl_gsm8k$"):
        load_corpus("taubench")


def test_step_rows_draw_each_row_once_per_epoch_in_a_seeded_order() -> None:
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(5)]
    source = TaskSource("gsm8k", rows, [], seed=3)
    drawn = [[row["prompt"][0]["content"] for row in source.step_rows(step, 2)] for step in range(5)]
    flat = [content for step in drawn for content in step]
    assert sorted(flat[:5]) == sorted(flat[5:]) == ["0", "1", "2", "3", "4"]  # two epochs, no row twice in one
    assert flat[:5] != flat[5:]  # reshuffled per epoch
    same_seed = TaskSource("other", rows, [], seed=3)
    assert [r["prompt"] for r in source.step_rows(1, 2)] == [r["prompt"] for r in same_seed.step_rows(1, 2)]
    assert [r["prompt"] for r in TaskSource("gsm8k", rows, [], seed=4).step_rows(0, 5)] != [
        r["prompt"] for r in source.step_rows(0, 5)]
    assert all(row["env_class"] == "gsm8k" for row in source.step_rows(7, 3)) and "env_class" not in rows[0]


def test_read_parquet_files_names_the_key_on_a_bad_file_or_no_rows() -> None:
    def load(path: str) -> list[dict]:
        if path == "bad":
            raise OSError("unreadable")
        return [] if path == "empty" else [{"path": path}]

    assert read_parquet_files(("a", "b"), "data.train_data", load) == [{"path": "a"}, {"path": "b"}]
    assert read_parquet_files((), "data.val_data", load) == []
    with pytest.raises(ConfigError, match="^data.train_data: bad: unreadable; point it at a parquet file"):
        read_parquet_files(("a", "bad"), "data.train_data", load)
    with pytest.raises(ConfigError, match=r"^data.val_data=\['empty'\] holds no rows; check the files$"):
        read_parquet_files(("empty",), "data.val_data", load)


def test_build_task_sources_refuses_an_unknown_variant_or_an_unregistered_row_env(tmp_path: Path) -> None:
    run = run_config(tmp_path, "+tenants=[{seed:1},{seed:2,name:other}]")
    sources = build_task_sources(run.recipe, list(run.tenants), None, run.seed)
    assert list(sources) == ["tenant-0", "other"] and sources["other"].seed == 2
    with pytest.raises(ConfigError, match="^tenant tenant-0: unknown gsm8k task variant 'nope'"):
        build_task_sources(run.recipe, [replace(run.tenants[0], task_variant="nope")], None, 0)
    with pytest.raises(ConfigError, match="^tenant tenant-0: env_class=no_such_env is not a registered skyrl-gym"):
        build_task_sources(run.recipe, [replace(run.tenants[0], env_class="no_such_env")], None, 0)
    assert "no_such_env" not in skyrl_gym.registry


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
