"""The tau-bench retail recipe as a plugin: the retail tasks of ``recipe.data_path`` (default: the project's
synthetic retail folder) on the ``taubench_retail`` environment, with a scripted customer or, with
``recipe.user=llm``, the base model (no adapter) as the customer."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from skyrl_clora.config.schema import ConfigError, RecipeConfig
from skyrl_clora.recipes.plugin import ChatFunction, EpisodeEnv, TaskSource
from skyrl_clora.recipes.taubench.data import dataset_rows
from skyrl_clora.recipes.taubench.env import register_taubench_env
from skyrl_clora.recipes.taubench.synthetic import make_synthetic_retail
from skyrl_clora.recipes.taubench.users import LLMUser
from skyrl_clora.tenants import TenantSpec

# Environment workers of a tenant's generator when the customer is the LLM: its env steps sample.
LLM_USER_ENV_WORKERS = 8


@dataclass(frozen=True)
class TauBenchOptions:
    """The recipe's own keys: ``recipe.data_path`` (a tau-bench retail data folder; None: the project's
    synthetic one) and ``recipe.user`` (``scripted``: a deterministic customer; ``llm``: the base model)."""

    data_path: str | None = None
    user: str = "scripted"

    def __post_init__(self) -> None:
        if self.user not in ("scripted", "llm"):
            raise ConfigError(f"recipe.user={self.user} is unknown; use scripted or llm")
        if self.data_path is not None and not Path(self.data_path).exists():
            raise ConfigError(f"recipe.data_path={self.data_path} does not exist; point it at an existing folder")


class TauBenchRecipe:
    """:class:`~skyrl_clora.recipes.plugin.Recipe` for tau-bench retail (every tenant takes the folder's
    train tasks in its own seeded order and is evaluated on its first ``eval_prompts`` test tasks)."""

    env_classes = ("taubench_retail",)
    options_type = TauBenchOptions

    def task_source(self, config: RecipeConfig, spec: TenantSpec, max_steps: int | None, run_seed: int) -> TaskSource:
        register_taubench_env()
        data_path = config.options.data_path or str(synthetic_retail_path())
        try:
            train = dataset_rows(data_path, "train")
            evaluation = dataset_rows(data_path, "test")[: config.eval_prompts]
        except (OSError, ValueError) as error:
            raise ConfigError(f"recipe.data_path={data_path}: {error}; point it at a tau-bench retail data folder") from None
        return TaskSource(config.env_class, train, evaluation, spec.seed, spec.env_class)

    def episode_env(self, config: RecipeConfig, spec: TenantSpec, chat: ChatFunction | None) -> EpisodeEnv:
        """With ``recipe.user=llm``, each episode's customer is an :class:`LLMUser` over ``chat`` (user ids
        ``customer-s<tenant seed>-<conversation hash>``, so that its sampling is reproducible)."""
        if config.options.user != "llm":
            return EpisodeEnv()
        if chat is None:
            raise ConfigError("recipe.user=llm needs the backend's chat completions; use recipe.user=scripted")

        def user_factory() -> LLMUser:
            async def generate(messages: list[dict[str, str]]) -> str:
                conversation = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
                return await chat(messages, config.max_generate_length, f"customer-s{spec.seed}-{conversation}")

            return LLMUser(generate, loop=asyncio.get_running_loop())

        return EpisodeEnv(args={"user_factory": user_factory}, workers=LLM_USER_ENV_WORKERS)

    def refuses(self, config: RecipeConfig, backend: str) -> str | None:
        if config.train_data or config.val_data:
            return "data.train_data / data.val_data: tau-bench reads its tasks from recipe.data_path; drop them"
        if backend == "skyrl" and config.options.user == "llm":
            return ("recipe.user=llm (the base model as the customer) runs on backend=embedded only; "
                    "use recipe.user=scripted with backend=skyrl")
        return None


def synthetic_retail_path() -> Path:
    """The project's own small retail data folder (made once under the cache), used when no
    ``recipe.data_path`` is given."""
    from skyrl_clora.tiny_base.pretrain import default_cache_root

    path = default_cache_root() / "data" / "taubench_retail_synthetic"
    if not (path / "tasks_test.json").is_file():
        make_synthetic_retail(path)
    return path


RECIPE = TauBenchRecipe()
