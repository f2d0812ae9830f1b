"""The GSM8K recipe as a plugin: generated GSM8K-format word problems (or SkyRL's GSM8K parquet files) on the
agentic calculator environment ``gsm8k_calc``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skyrl_clora.config.schema import RecipeConfig
from skyrl_clora.recipes.gsm8k import corpus
from skyrl_clora.recipes.gsm8k.env import register_gsm8k_env
from skyrl_clora.recipes.gsm8k.problems import load_gsm8k_parquet, make_dataset_rows
from skyrl_clora.recipes.plugin import (
    EVAL_SEED_OFFSET, ChatFunction, CorpusSettings, Episode, EpisodeEnv, TaskSource, read_parquet_files,
)
from skyrl_clora.tenants import TenantSpec


@dataclass(frozen=True)
class GSM8KOptions:
    """The GSM8K recipe has no keys beyond :class:`RecipeConfig`'s."""


class GSM8KRecipe:
    """:class:`~skyrl_clora.recipes.plugin.Recipe` of env ``gsm8k_calc``: per-tenant problems seeded by the tenant
    (``task_variant`` standard or hard) unless ``data.train_data`` / ``data.val_data`` name SkyRL GSM8K parquet
    files (mapped to the calculator task); also a :class:`~skyrl_clora.recipes.plugin.PretrainingCorpus`
    (``corpus``), the tiny base model's default."""

    env_classes = ("gsm8k_calc",)
    options_type = GSM8KOptions

    def task_source(self, config: RecipeConfig, spec: TenantSpec, max_steps: int | None, run_seed: int) -> TaskSource:
        register_gsm8k_env()
        train, evaluation = task_rows(config, spec, max_steps, run_seed, load_gsm8k_parquet, make_dataset_rows)
        return TaskSource(config.env_class, train, evaluation, spec.seed, spec.env_class)

    def episode_env(self, config: RecipeConfig, spec: TenantSpec, chat: ChatFunction | None) -> EpisodeEnv:
        return EpisodeEnv()

    def refuses(self, config: RecipeConfig, backend: str) -> str | None:
        return None

    def pretraining_episodes(self, settings: CorpusSettings, solve_rate: float) -> list[Episode]:
        return corpus.pretraining_episodes(settings, solve_rate)


SYNTHETIC_TRAIN_ROWS = 64
"""Synthetic training rows per tenant at least (more when ``trainer.max_training_steps`` needs more)."""


def task_rows(config: RecipeConfig, spec: TenantSpec, max_steps: int | None, run_seed: int,
              load: Callable[[str], list[dict[str, Any]]],
              make: Callable[..., list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, evaluation rows) of a GSM8K-format recipe: the rows of ``data.train_data`` /
    ``data.val_data`` read by ``load`` (every file, concatenated; every validation row evaluated, as SkyRL does), or
    synthetic ones made by ``make(n, seed=, variant=, split=)``: seeded by the tenant for training, by the run for
    evaluation (``recipe.eval_prompts`` problems; every tenant is evaluated on the same ones)."""
    if config.train_data:
        train = read_parquet_files(config.train_data, "data.train_data", load)
    else:
        needed = (max_steps or 0) * config.prompts_per_step
        train = make(max(needed, SYNTHETIC_TRAIN_ROWS), seed=spec.seed, variant=spec.task_variant, split="train")
    if config.val_data:
        evaluation = read_parquet_files(config.val_data, "data.val_data", load)
    else:
        evaluation = make(config.eval_prompts, seed=run_seed + EVAL_SEED_OFFSET, variant=spec.task_variant, split="test")
    return train, evaluation


RECIPE = GSM8KRecipe()
