"""Tests of ``skyrl_clora.recipes.gsm8k.recipe``: the GSM8K recipe plugin. Without data files each tenant trains on
generated problems seeded by its own seed and variant (enough rows for the planned steps, at least
``SYNTHETIC_TRAIN_ROWS``) and every tenant is evaluated on the same ``recipe.eval_prompts`` problems seeded by the
run; ``data.train_data`` / ``data.val_data`` files in SkyRL's GSM8K schema replace them (all files, concatenated,
mapped to the calculator task), and one it cannot read is a one-line config error naming the key. The recipe serves
``gsm8k_calc`` (registering it), refuses no backend, adds nothing to episodes and is the calculator corpus."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import skyrl_gym

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.recipes.gsm8k import corpus
from skyrl_clora.recipes.gsm8k.problems import load_gsm8k_parquet, make_dataset_rows, save_rows_parquet
from skyrl_clora.recipes.gsm8k.recipe import RECIPE, SYNTHETIC_TRAIN_ROWS, task_rows
from skyrl_clora.recipes.plugin import EVAL_SEED_OFFSET, CorpusSettings, EpisodeEnv, load_recipe
from skyrl_clora.recipes.skyrl_gsm8k.data import make_skyrl_rows
from tests.support.recipe_runs import run_config


def test_synthetic_rows_are_seeded_per_tenant_for_training_and_per_run_for_evaluation(tmp_path: Path) -> None:
    run = run_config(tmp_path, "+tenants=[{seed:4},{seed:9,task_variant:hard}]", "trainer.seed=2",
                     "recipe.eval_prompts=5")
    assert load_recipe(run.recipe.name) is RECIPE and RECIPE.env_classes == ("gsm8k_calc",)
    first, second = (RECIPE.task_source(run.recipe, spec, None, run.seed) for spec in run.tenants)
    assert "gsm8k_calc" in skyrl_gym.registry
    assert first.train_rows == make_dataset_rows(SYNTHETIC_TRAIN_ROWS, seed=4, variant="standard", split="train")
    assert second.train_rows == make_dataset_rows(SYNTHETIC_TRAIN_ROWS, seed=9, variant="hard", split="train")
    assert first.eval_rows == make_dataset_rows(5, seed=2 + EVAL_SEED_OFFSET, variant="standard", split="test")
    assert (first.seed, second.seed, first.env_class, first.tenant_env_class) == (4, 9, "gsm8k_calc", None)


def test_enough_synthetic_rows_for_the_planned_steps(tmp_path: Path) -> None:
    run = run_config(tmp_path, "trainer.train_batch_size=6")
    spec = run.tenants[0]
    assert len(RECIPE.task_source(run.recipe, spec, 10, 0).train_rows) == SYNTHETIC_TRAIN_ROWS
    assert len(RECIPE.task_source(run.recipe, spec, 20, 0).train_rows) == 120


def test_data_files_replace_the_synthetic_rows(tmp_path: Path) -> None:
    first = save_rows_parquet(make_skyrl_rows(3, seed=0), tmp_path / "a.parquet")
    second = save_rows_parquet(make_skyrl_rows(2, seed=1), tmp_path / "b.parquet")
    val = save_rows_parquet(make_skyrl_rows(4, seed=2, split="test"), tmp_path / "val.parquet")
    run = run_config(tmp_path, f"data.train_data=['{first}','{second}']", f"data.val_data=['{val}']",
                     "recipe.eval_prompts=1")
    source = RECIPE.task_source(run.recipe, run.tenants[0], 100, 0)
    questions = [row["extra_info"]["question"] for row in make_skyrl_rows(3, seed=0) + make_skyrl_rows(2, seed=1)]
    assert [row["prompt"][1]["content"] for row in source.train_rows] == questions
    assert {row["env_class"] for row in source.train_rows + source.eval_rows} == {"gsm8k_calc"}
    assert len(source.eval_rows) == 4  # every validation row, whatever recipe.eval_prompts says


def test_an_unreadable_data_file_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    run = run_config(tmp_path)
    config = dataclasses.replace(run.recipe, val_data=(str(tmp_path / "missing.parquet"),))
    with pytest.raises(ConfigError, match=r"^data\.val_data: .*missing\.parquet: gsm8k parquet file not found"):
        task_rows(config, run.tenants[0], None, 0, load_gsm8k_parquet, make_dataset_rows)
    with pytest.raises(ConfigError, match=r"^data\.val_data=\[.*\] holds no rows"):
        task_rows(config, run.tenants[0], None, 0, lambda path: [], make_dataset_rows)


def test_episodes_refusals_and_corpus(tmp_path: Path) -> None:
    run = run_config(tmp_path)
    assert RECIPE.episode_env(run.recipe, run.tenants[0], None) == EpisodeEnv()
    assert RECIPE.refuses(run.recipe, "embedded") is None and RECIPE.refuses(run.recipe, "skyrl") is None
    settings = CorpusSettings(count=6, hard_fraction=0.5, seed=1)
    assert RECIPE.pretraining_episodes(settings, 0.5) == corpus.pretraining_episodes(settings, 0.5)
