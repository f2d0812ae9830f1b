"""SkyRL's own GSM8K recipe as a plugin: skyrl-gym's single-turn ``gsm8k`` env (reused as it is) on SkyRL-format
rows: ``data.train_data`` / ``data.val_data`` parquet files exactly as SkyRL's gsm8k_dataset.py writes them, or
generated problems in that format."""

from __future__ import annotations

from dataclasses import dataclass

import skyrl_gym

from skyrl_clora.config.schema import RecipeConfig
from skyrl_clora.recipes.gsm8k.recipe import task_rows
from skyrl_clora.recipes.plugin import ChatFunction, CorpusSettings, Episode, EpisodeEnv, TaskSource
from skyrl_clora.recipes.skyrl_gsm8k import corpus
from skyrl_clora.recipes.skyrl_gsm8k.data import ENV_CLASS, load_skyrl_parquet, make_skyrl_rows
from skyrl_clora.tenants import TenantSpec


@dataclass(frozen=True)
class SkyRLGSM8KOptions:
    """The recipe has no keys beyond :class:`RecipeConfig`'s."""


class SkyRLGSM8KRecipe:
    """:class:`~skyrl_clora.recipes.plugin.Recipe` of skyrl-gym's ``gsm8k`` env (registered by skyrl-gym itself);
    also a :class:`~skyrl_clora.recipes.plugin.PretrainingCorpus` (``corpus``)."""

    env_classes = (ENV_CLASS,)
    options_type = SkyRLGSM8KOptions

    def task_source(self, config: RecipeConfig, spec: TenantSpec, max_steps: int | None, run_seed: int) -> TaskSource:
        if ENV_CLASS not in skyrl_gym.registry:  # skyrl-gym registers its envs on import; be loud if it stops
            raise RuntimeError(f"skyrl-gym no longer registers {ENV_CLASS!r}; this recipe reuses its env class")
        train, evaluation = task_rows(config, spec, max_steps, run_seed, load_skyrl_parquet, make_skyrl_rows)
        return TaskSource(config.env_class, train, evaluation, spec.seed, spec.env_class)

    def episode_env(self, config: RecipeConfig, spec: TenantSpec, chat: ChatFunction | None) -> EpisodeEnv:
        return EpisodeEnv()

    def refuses(self, config: RecipeConfig, backend: str) -> str | None:
        return None

    def pretraining_episodes(self, settings: CorpusSettings, solve_rate: float) -> list[Episode]:
        return corpus.pretraining_episodes(settings, solve_rate)


RECIPE = SkyRLGSM8KRecipe()
