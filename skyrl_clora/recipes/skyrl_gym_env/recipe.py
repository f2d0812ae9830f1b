"""Any env class registered with skyrl-gym that no other recipe serves (SkyRL's ``aime``, its examples' ``multiply``
once registered, a user's own), on SkyRL-format parquet files: ``data.train_data`` and ``data.val_data`` read as
SkyRL's ``PromptDataset`` yields them, row for row. A row is SkyRL's dataset schema: a chat ``prompt``, an optional
``env_class`` (SkyRL's rule: the row's when present, else ``environment.env_class``) and the env's extras (e.g.
``reward_spec`` or ``reward_model`` with its ``ground_truth``, ``extra_info``, ``data_source``). No synthetic
problems: the run needs ``data.train_data``; without ``data.val_data`` the tenants are not evaluated. Its defaults are
SkyRL's (``recipe=skyrl``, conf/recipe/skyrl.yaml), so the recipe has no config file of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_clora.config.schema import RecipeConfig
from skyrl_clora.recipes.plugin import (
    ANY_REGISTERED_ENV,
    ChatFunction,
    EpisodeEnv,
    TaskSource,
    load_skyrl_rows,
    read_parquet_files,
)
from skyrl_clora.tenants import TenantSpec


@dataclass(frozen=True)
class SkyRLGymEnvOptions:
    """The recipe has no keys beyond :class:`RecipeConfig`'s (``recipe.task_variant`` and ``recipe.eval_prompts``
    size synthetic problems, which it has none of)."""


class SkyRLGymEnvRecipe:
    """:class:`~skyrl_clora.recipes.plugin.Recipe` of every registered env class no other recipe serves (see the
    module docstring)."""

    env_classes = (ANY_REGISTERED_ENV,)
    options_type = SkyRLGymEnvOptions

    def task_source(self, config: RecipeConfig, spec: TenantSpec, max_steps: int | None, run_seed: int) -> TaskSource:
        train = read_parquet_files(config.train_data, "data.train_data", load_skyrl_rows)
        evaluation = read_parquet_files(config.val_data, "data.val_data", load_skyrl_rows)
        return TaskSource(config.env_class, train, evaluation, spec.seed, spec.env_class)

    def episode_env(self, config: RecipeConfig, spec: TenantSpec, chat: ChatFunction | None) -> EpisodeEnv:
        return EpisodeEnv()

    def refuses(self, config: RecipeConfig, backend: str) -> str | None:
        if not config.train_data:
            return (f"environment.env_class={config.env_class} has no recipe with synthetic problems here; give "
                    "data.train_data=['/path/train.parquet'] in SkyRL's dataset schema (prompt, env_class, "
                    "reward_spec, extra_info), e.g. from the SkyRL example's dataset script")
        return None


RECIPE = SkyRLGymEnvRecipe()
