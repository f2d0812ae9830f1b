"""Tests of ``skyrl_clora.recipes.skyrl_gym_env.recipe``: any env registered with skyrl-gym runs on SkyRL-format
parquet files. As a plugin: the rows of every ``data.train_data`` / ``data.val_data`` file, as SkyRL's
``PromptDataset`` yields them, a file it cannot read a one-line config error, and a run without training data
refused with the fix. End to end (``e2e``): skyrl-gym's own ``aime`` env on rows in its schema
(``reward_model.ground_truth``, no ``env_class`` column: ``environment.env_class`` names it) and a ``multiply`` env
as SkyRL's example registers it (rows naming ``env_class: multiply``, ``reward_spec.ground_truth``), each a short
CPU run on the micro model, the multiply one on both backends; an unregistered env class, a registered one without
data, and a row's unregistered ``env_class`` each a one-line error."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.main import main
from skyrl_clora.recipes.plugin import ANY_REGISTERED_ENV, EpisodeEnv, load_recipe, recipe_for_env
from skyrl_clora.recipes.skyrl_gym_env.recipe import RECIPE
from tests.support.recipe_runs import run_config


MULTIPLY = "multiply"


class MultiplyEnv(BaseTextEnv):
    """The multiplication env of SkyRL's examples (examples/train/multiply), as its docs describe it: the answer in
    ``\\boxed{...}``; reward 1 when it is the product, 0.5 for a wrong boxed answer, 0 without one; a wrong turn gets
    a feedback message until ``max_turns``."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.ground_truth = str(extras["reward_spec"]["ground_truth"]).strip()
        self.max_turns = extras.get("max_turns", 5)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        found = re.search(r"\\boxed\{([^}]+)\}", action)
        answer = found.group(1).strip() if found else None
        correct = answer == self.ground_truth
        reward = 1.0 if correct else 0.5 if answer is not None else 0.0
        if correct or self.turns >= self.max_turns:
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"parsed_answer": answer})
        feedback = "Please give your answer as \\boxed{answer}." if answer is None else f"{answer} is wrong; try again."
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": feedback}], reward=0.0, done=False,
                                     metadata={"parsed_answer": answer})


def register_multiply() -> None:
    if MULTIPLY not in skyrl_gym.registry:
        skyrl_gym.register(id=MULTIPLY, entry_point=f"{__name__}:{MultiplyEnv.__name__}")


def multiply_rows(n: int, split: str) -> list[dict[str, Any]]:
    """Rows in the schema of SkyRL's multiply_dataset.py."""
    rows = []
    for index in range(n):
        a, b = 3 + index % 7, 2 + index % 5
        rows.append({
            "data_source": "synthetic_multiply",
            "prompt": [{"role": "system", "content": "Answer with \\boxed{answer}."},
                       {"role": "user", "content": f"{a} * {b}"}],
            "env_class": MULTIPLY,
            "reward_spec": {"method": "rule", "ground_truth": str(a * b)},
            "extra_info": {"num_digits": 1, "split": split},
        })
    return rows


def aime_rows(n: int, split: str) -> list[dict[str, Any]]:
    """Rows in the schema of the AIME parquet files SkyRL's DAPO example evaluates on (``reward_model``, no
    ``env_class``)."""
    return [{"data_source": "aime", "ability": "math",
             "prompt": [{"role": "user", "content": f"What is {index} + {index}? Put the answer in \\boxed{{}}."}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * index)},
             "extra_info": {"index": index, "split": split}} for index in range(n)]


def write(rows: list[dict[str, Any]], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run_args(model: Path, out: Path, env_class: str, train: Path, val: Path, *extra: str) -> list[str]:
    return [f"trainer.policy.model.path={model}", "preset=demo", f"environment.env_class={env_class}",
            f"data.train_data=['{train}']", f"data.val_data=['{val}']", f"clora.output_dir={out}",
            "clora.progress=false", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
            "trainer.max_training_steps=2", "generator.sampling_params.max_generate_length=8",
            "trainer.max_prompt_length=200", "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=16",
            "sampler.max_lora_rank=8", *extra]


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["embedded", "skyrl"])
@pytest.mark.e2e
def test_a_registered_multiply_env_runs_on_its_own_parquet_schema(backend: str, micro_model_dir: Path,
                                                                  tmp_path: Path, without_production_extras: None) -> None:
    register_multiply()
    train = write(multiply_rows(8, "train"), tmp_path / "train.parquet")
    val = write(multiply_rows(3, "test"), tmp_path / "validation.parquet")
    out = tmp_path / "run"
    args = run_args(micro_model_dir, out, MULTIPLY, train, val, "generator.max_turns=2",
                    "generator.eval_n_samples_per_prompt=2", "+tenants=2", f"backend={backend}")
    assert main(args) == 0
    found = records(out)
    assert sorted((r["tenant"], r["step"]) for r in found if r["event"] == "step") == [
        (f"tenant-{i}", s) for i in range(2) for s in (1, 2)]
    evals = [r for r in found if r["event"] == "eval"]
    assert sorted((r["tenant"], r["step"]) for r in evals) == [(f"tenant-{i}", s) for i in range(2) for s in (0, 2)]
    for record in evals:  # every validation row, eval_n_samples_per_prompt episodes each, SkyRL's metric names
        assert record["episodes"] == 3 * 2
        for name in ("avg_score", "pass_at_2", "mean_positive_reward"):
            assert 0 <= record[f"eval/all/{name}"] <= 1 and f"eval/synthetic_multiply/{name}" in record
    assert all(r["episodes"] == 2 * 2 for r in found if r["event"] == "step")


@pytest.mark.e2e
def test_skyrl_gyms_aime_env_runs_with_the_run_level_env_class(micro_model_dir: Path, tmp_path: Path) -> None:
    train = write(aime_rows(6, "train"), tmp_path / "train.parquet")
    val = write(aime_rows(2, "test"), tmp_path / "validation.parquet")
    out = tmp_path / "run"
    assert main(run_args(micro_model_dir, out, "aime", train, val)) == 0
    found = records(out)
    assert [r["step"] for r in found if r["event"] == "step"] == [1, 2]
    assert [(r["step"], r["episodes"]) for r in found if r["event"] == "eval"] == [(0, 2), (2, 2)]
    assert all("eval/aime/pass_at_1" in r for r in found if r["event"] == "eval")


@pytest.mark.e2e
def test_an_unregistered_env_without_a_recipe_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["environment.env_class=no_such_env", f"clora.output_dir={tmp_path}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "environment.env_class=no_such_env has no recipe here and is not registered" in errors[0]


@pytest.mark.e2e
def test_a_registered_env_without_data_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert recipe_for_env("aime") == "skyrl_gym_env"
    assert main(["environment.env_class=aime", f"clora.output_dir={tmp_path}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "give data.train_data=" in errors[0], errors


@pytest.mark.e2e
def test_a_rows_unregistered_env_class_is_refused_before_any_work(micro_model_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    rows = multiply_rows(4, "train")
    rows[1]["env_class"] = "not_registered_anywhere"
    train = write(rows, tmp_path / "train.parquet")
    out = tmp_path / "run"
    assert main(run_args(micro_model_dir, out, "gsm8k", train, train)) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "env_class=not_registered_anywhere is not a registered skyrl-gym" in errors[0], errors


def test_rows_of_every_file_are_read_as_skyrl_yields_them(tmp_path: Path) -> None:
    first = write(aime_rows(2, "train"), tmp_path / "a.parquet")
    second = write(multiply_rows(3, "train"), tmp_path / "b.parquet")
    val = write(aime_rows(1, "test"), tmp_path / "val.parquet")
    run = run_config(tmp_path, "environment.env_class=aime", f"data.train_data=['{first}','{second}']",
                     f"data.val_data=['{val}']", "+tenants=[{seed:6}]")
    assert recipe_for_env("aime") == run.recipe.name == "skyrl_gym_env" and load_recipe("skyrl_gym_env") is RECIPE
    assert RECIPE.env_classes == (ANY_REGISTERED_ENV,)
    source = RECIPE.task_source(run.recipe, run.tenants[0], 50, 0)
    assert source.train_rows == aime_rows(2, "train") + multiply_rows(3, "train")  # each file's rows, unchanged
    assert source.eval_rows == aime_rows(1, "test")
    assert (source.env_class, source.seed) == ("aime", 6)
    assert [row["env_class"] for row in source.step_rows(0, 5)].count(MULTIPLY) == 3


def test_without_validation_data_there_is_nothing_to_evaluate(tmp_path: Path) -> None:
    train = write(multiply_rows(2, "train"), tmp_path / "train.parquet")
    run = run_config(tmp_path, "environment.env_class=aime", f"data.train_data=['{train}']")
    assert RECIPE.task_source(run.recipe, run.tenants[0], None, 0).eval_rows == []


def test_a_file_without_chat_prompts_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    valid = write(aime_rows(1, "train"), tmp_path / "valid.parquet")
    train = write([{"prompt": "just text", "reward_spec": {"ground_truth": "1"}}], tmp_path / "train.parquet")
    run = run_config(tmp_path, "environment.env_class=aime", f"data.train_data=['{valid}']")
    config = dataclasses.replace(run.recipe, train_data=(str(train),))
    with pytest.raises(ConfigError, match=r"^data\.train_data: .*train\.parquet: row 0 has no chat prompt"):
        RECIPE.task_source(config, run.tenants[0], None, 0)


def test_a_run_without_training_data_is_refused_with_the_fix(tmp_path: Path) -> None:
    train = write(aime_rows(1, "train"), tmp_path / "train.parquet")
    run = run_config(tmp_path, "environment.env_class=aime", f"data.train_data=['{train}']")
    assert RECIPE.refuses(run.recipe, "embedded") is None and RECIPE.refuses(run.recipe, "skyrl") is None
    refusal = RECIPE.refuses(dataclasses.replace(run.recipe, train_data=()), "embedded")
    assert refusal is not None
    assert refusal.startswith("environment.env_class=aime has no recipe with synthetic problems")
    assert "give data.train_data=['/path/train.parquet']" in refusal
    assert RECIPE.episode_env(run.recipe, run.tenants[0], None) == EpisodeEnv()
