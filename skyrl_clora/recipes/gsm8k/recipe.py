"""The GSM8K recipe as a plugin: generated GSM8K-format word problems (or SkyRL's GSM8K parquet files) on the
agentic calculator environment ``gsm8k_calc``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skyrl_clora.config import ConfigError, RecipeConfig
from skyrl_clora.recipes.gsm8k import corpus
from skyrl_clora.recipes.gsm8k.env import register_gsm8k_env
from skyrl_clora.recipes.gsm8k.problems import load_gsm8k_parquet, make_dataset_rows
from skyrl_clora.recipes.plugin import EVAL_SEED_OFFSET, ChatFunction, CorpusSettings, Episode, EpisodeEnv, TaskSource
from skyrl_clora.tenants import TenantSpec


@dataclass(frozen=True)
class GSM8KOptions:
    """The GSM8K recipe has no keys beyond :class:`RecipeConfig`'s."""


class GSM8KRecipe:
    """:class:`~skyrl_clora.recipes.plugin.Recipe`: per-tenant problems seeded by the tenant (``task_variant``
    standard or hard) unless ``recipe.train_data`` / ``recipe.val_data`` name parquet files; also a
    :class:`~skyrl_clora.recipes.plugin.PretrainingCorpus` (``corpus``), the tiny base model's default."""

    options_type = GSM8KOptions

    def task_source(self, config: RecipeConfig, spec: TenantSpec, steps: int, run_seed: int) -> TaskSource:
        register_gsm8k_env()
        needed = steps * config.prompts_per_step
        if config.train_data is not None:
            train = _parquet(config.train_data, "recipe.train_data")
        else:
            train = make_dataset_rows(max(needed, 64), seed=spec.seed, variant=spec.task_variant, split="train")
        if config.val_data is not None:
            evaluation = _parquet(config.val_data, "recipe.val_data")[: config.eval_prompts]
            if not evaluation and config.eval_prompts:
                raise ConfigError(f"recipe.val_data={config.val_data} holds no rows; check the file, or set "
                                  "recipe.eval_prompts=0 to run without evaluation")
        else:
            evaluation = make_dataset_rows(
                config.eval_prompts, seed=run_seed + EVAL_SEED_OFFSET, variant=spec.task_variant, split="test"
            )
        if not train:
            raise ConfigError(f"recipe.train_data={config.train_data} holds no rows; check the file")
        return TaskSource(spec.env_class or config.env_class, train, evaluation, spec.seed)

    def episode_env(self, config: RecipeConfig, spec: TenantSpec, chat: ChatFunction | None) -> EpisodeEnv:
        return EpisodeEnv()

    def refuses(self, config: RecipeConfig, backend: str) -> str | None:
        return None

    def pretraining_episodes(self, settings: CorpusSettings, solve_rate: float) -> list[Episode]:
        return corpus.pretraining_episodes(settings, solve_rate)


def _parquet(path: str, key: str) -> list[dict[str, Any]]:
    """``load_gsm8k_parquet(path)``; a file it cannot read is a :class:`ConfigError` naming ``key``."""
    try:
        return load_gsm8k_parquet(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}={path}: {error}; point it at a parquet file from SkyRL's gsm8k_dataset.py") from None


RECIPE = GSM8KRecipe()
