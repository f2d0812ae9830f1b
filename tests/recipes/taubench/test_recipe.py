"""Tests of ``skyrl_clora.recipes.taubench.recipe``: the tau-bench recipe plugin. Its own keys (``recipe.user``
scripted or llm, ``recipe.data_path`` an existing folder) are checked when the run is built; every tenant takes the
folder's train tasks and is evaluated on its first ``recipe.eval_prompts`` test tasks, from the project's synthetic
folder (made once under the cache) when no folder is given, a folder that is no retail data a one-line config error;
with ``recipe.user=llm`` each episode's customer is an ``LLMUser`` over the backend's chat, with reproducible user
ids; and the recipe refuses data files, and the LLM customer on backend=skyrl."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import skyrl_gym

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.recipes.plugin import EpisodeEnv
from skyrl_clora.recipes.taubench.data import dataset_rows
from skyrl_clora.recipes.taubench.recipe import LLM_USER_ENV_WORKERS, RECIPE, TauBenchOptions, synthetic_retail_path
from skyrl_clora.recipes.taubench.users import LLMUser
from tests.support.recipe_runs import run_config
from tests.support.taubench_retail import data_dir  # noqa: F401 (data_dir: a fixture)


def test_the_recipes_own_keys_are_checked(tmp_path: Path) -> None:
    run = run_config(tmp_path, "recipe=taubench", f"recipe.data_path={tmp_path}", "recipe.user=llm")
    assert run.recipe.name == "taubench" and run.recipe.options == TauBenchOptions(data_path=str(tmp_path), user="llm")
    with pytest.raises(ConfigError, match="recipe.user=human is unknown; use scripted or llm"):
        TauBenchOptions(user="human")
    with pytest.raises(ConfigError, match=r"recipe.data_path=.*nowhere does not exist"):
        TauBenchOptions(data_path=str(tmp_path / "nowhere"))


def test_tenants_train_on_the_folders_train_tasks_and_are_evaluated_on_its_first_test_tasks(
        tmp_path: Path, data_dir: Path) -> None:
    run = run_config(tmp_path, "recipe=taubench", f"recipe.data_path={data_dir}", "recipe.eval_prompts=3",
                     "+tenants=[{seed:5}]")
    source = RECIPE.task_source(run.recipe, run.tenants[0], None, 0)
    assert "taubench_retail" in skyrl_gym.registry and RECIPE.env_classes == ("taubench_retail",)
    assert source.train_rows == dataset_rows(data_dir, "train") and len(source.train_rows) == 7
    assert source.eval_rows == dataset_rows(data_dir, "test")[:3]
    assert (source.env_class, source.seed) == ("taubench_retail", 5)


def test_without_a_folder_the_synthetic_one_is_made_once_under_the_cache(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYRL_CLORA_CACHE", str(tmp_path / "cache"))
    path = synthetic_retail_path()
    assert path == tmp_path / "cache" / "data" / "taubench_retail_synthetic" and (path / "tasks_test.json").is_file()
    (path / "wiki.md").write_text("kept")
    assert synthetic_retail_path() == path and (path / "wiki.md").read_text() == "kept"
    run = run_config(tmp_path, "recipe=taubench")
    assert RECIPE.task_source(run.recipe, run.tenants[0], None, 0).train_rows == dataset_rows(path, "train")


def test_a_folder_without_retail_data_is_a_config_error(tmp_path: Path) -> None:
    run = run_config(tmp_path, "recipe=taubench", f"recipe.data_path={tmp_path}")
    with pytest.raises(ConfigError,
                       match=rf"^recipe.data_path={tmp_path}: .* has no users\.json; point it at a tau-bench"):
        RECIPE.task_source(run.recipe, run.tenants[0], None, 0)


def test_the_llm_customer_samples_the_backends_chat_with_reproducible_user_ids(tmp_path: Path) -> None:
    run = run_config(tmp_path, "recipe=taubench", "recipe.user=llm", "+tenants=[{seed:7}]")
    assert RECIPE.episode_env(dataclasses.replace(run.recipe, options=TauBenchOptions()), run.tenants[0], None) == (
        EpisodeEnv())
    with pytest.raises(ConfigError, match="recipe.user=llm needs the backend's chat completions"):
        RECIPE.episode_env(run.recipe, run.tenants[0], None)
    calls = []

    async def chat(messages: list[dict[str, str]], max_tokens: int, user: str) -> str:
        calls.append((messages, max_tokens, user))
        return "I want a refund."

    episode = RECIPE.episode_env(run.recipe, run.tenants[0], chat)
    assert set(episode.args) == {"user_factory"} and episode.workers == LLM_USER_ENV_WORKERS

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}]

    async def first_messages() -> tuple[LLMUser, list[str]]:
        user = episode.args["user_factory"]()
        return user, [await user.generate(messages), await user.generate(messages[:1])]

    user, texts = asyncio.run(first_messages())
    assert isinstance(user, LLMUser) and texts == ["I want a refund."] * 2
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    assert calls[0] == (messages, run.recipe.max_generate_length, f"customer-s7-{digest}")
    assert calls[1][2].startswith("customer-s7-") and calls[1][2] != calls[0][2]


def test_data_files_and_the_llm_customer_on_skyrl_are_refused(tmp_path: Path) -> None:
    run = run_config(tmp_path, "recipe=taubench")
    assert RECIPE.refuses(run.recipe, "embedded") is None and RECIPE.refuses(run.recipe, "skyrl") is None
    with_data = dataclasses.replace(run.recipe, train_data=("train.parquet",))
    refusal = RECIPE.refuses(with_data, "embedded")
    assert refusal is not None and refusal.startswith("data.train_data / data.val_data: tau-bench reads its tasks")
    llm = dataclasses.replace(run.recipe, options=TauBenchOptions(user="llm"))
    assert RECIPE.refuses(llm, "embedded") is None
    refusal = RECIPE.refuses(llm, "skyrl")
    assert refusal is not None
    assert refusal.startswith("recipe.user=llm (the base model as the customer) runs on backend=embedded only")
