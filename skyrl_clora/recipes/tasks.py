"""Per-tenant task data for the orchestrator: SkyRL dataset rows for each RL step and for evaluation.

A row is what SkyRL's prompt dataset yields: ``{"prompt": [messages], "env_class": str, ...extras}``; every
key other than ``prompt`` and ``env_class`` is passed to the environment as its ``extras``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_clora.config import ConfigError, RecipeConfig
from skyrl_clora.tenants import TenantSpec

EVAL_SEED_OFFSET = 1_000_003


@dataclass
class TaskSource:
    """Training rows drawn per step with the tenant's seed (without replacement, reshuffled per epoch) and a
    fixed evaluation set shared by all tenants of a run."""

    env_class: str
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    seed: int

    def step_rows(self, step: int, n: int) -> list[dict[str, Any]]:
        """The ``n`` training rows of RL step ``step`` (0-based)."""
        rows = []
        for k in range(step * n, (step + 1) * n):
            epoch, offset = divmod(k, len(self.train_rows))
            order = list(range(len(self.train_rows)))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            rows.append(self.train_rows[order[offset]])
        return [self._with_env(row) for row in rows]

    def evaluation_rows(self) -> list[dict[str, Any]]:
        return [self._with_env(row) for row in self.eval_rows]

    def _with_env(self, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "env_class": self.env_class}


def build_task_sources(recipe: RecipeConfig, specs: list[TenantSpec], steps: int, run_seed: int) -> dict[str, TaskSource]:
    """Every tenant's data, by tenant name, built before anything else starts: data that cannot be read, an
    unknown task variant or an environment that skyrl-gym does not know is a one-line :class:`ConfigError`
    (exit status 2), not a tenant failing once the run is under way."""
    import skyrl_gym

    sources = {}
    for spec in specs:
        try:
            source = build_task_source(recipe, spec, steps, run_seed)
        except ValueError as error:  # a ConfigError, or e.g. an unknown task variant
            raise ConfigError(f"tenant {spec.name}: {error}") from None
        if source.env_class not in skyrl_gym.registry:
            raise ConfigError(f"tenant {spec.name}: env_class={source.env_class} is not a registered skyrl-gym "
                              f"environment; register it before the run, or leave env_class to the recipe")
        sources[spec.name] = source
    return sources


def build_task_source(recipe: RecipeConfig, spec: TenantSpec, steps: int, run_seed: int) -> TaskSource:
    """The tenant's data for ``recipe``; registers the recipe's skyrl-gym environment."""
    if recipe.name == "gsm8k":
        from skyrl_clora.recipes.gsm8k.env import register_gsm8k_env
        from skyrl_clora.recipes.gsm8k.problems import make_dataset_rows

        register_gsm8k_env()
        needed = steps * recipe.prompts_per_step
        if recipe.train_data is not None:
            train = _gsm8k_file(recipe.train_data, "recipe.train_data")
        else:
            train = make_dataset_rows(max(needed, 64), seed=spec.seed, variant=spec.task_variant, split="train")
        if recipe.val_data is not None:
            evaluation = _gsm8k_file(recipe.val_data, "recipe.val_data")[: recipe.eval_prompts]
        else:
            evaluation = make_dataset_rows(
                recipe.eval_prompts, seed=run_seed + EVAL_SEED_OFFSET, variant=spec.task_variant, split="test"
            )
        if not train:
            raise ConfigError(f"recipe.train_data={recipe.train_data} holds no rows; check the file")
        return TaskSource(spec.env_class or recipe.env_class, train, evaluation, spec.seed)
    if recipe.name == "taubench":
        from skyrl_clora.recipes.taubench.data import dataset_rows
        from skyrl_clora.recipes.taubench.env import register_taubench_env

        register_taubench_env()
        data_path = recipe.data_path or str(synthetic_retail_path())
        try:
            train = dataset_rows(data_path, "train")
            evaluation = dataset_rows(data_path, "test")[: recipe.eval_prompts]
        except (OSError, ValueError) as error:
            raise ConfigError(f"recipe.data_path={data_path}: {error}; point it at a tau-bench retail data folder") from None
        return TaskSource(spec.env_class or recipe.env_class, train, evaluation, spec.seed)
    raise ConfigError(f"recipe={recipe.name} has no task data; use recipe=gsm8k or recipe=taubench")


def _gsm8k_file(path: str, key: str) -> list[dict[str, Any]]:
    """``load_gsm8k_parquet(path)``; a file it cannot read is a :class:`ConfigError` naming ``key``."""
    from skyrl_clora.recipes.gsm8k.problems import load_gsm8k_parquet

    try:
        return load_gsm8k_parquet(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}={path}: {error}; point it at a parquet file from SkyRL's gsm8k_dataset.py") from None


def synthetic_retail_path() -> Path:
    """The project's own small retail data folder (made once under the cache), used when no
    ``recipe.data_path`` is given."""
    from skyrl_clora.recipes.taubench.synthetic import make_synthetic_retail
    from skyrl_clora.recipes.tiny_base.pretrain import default_cache_root

    path = default_cache_root() / "data" / "taubench_retail_synthetic"
    if not (path / "tasks_test.json").is_file():
        make_synthetic_retail(path)
    return path
