"""A run's configuration built from ``skyrl_clora.main``'s command-line overrides exactly as ``main`` builds it
(imported as ``tests.support.recipe_runs``), for the tests of the recipe plugins' ``task_source``, ``episode_env``
and ``refuses``: its :class:`~skyrl_clora.config.schema.RecipeConfig` (``run.recipe``, the recipe's own options in
``run.recipe.options``) and tenants (``run.tenants``)."""

from __future__ import annotations

from pathlib import Path

from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.config.schema import RunConfig


def run_config(tmp_path: Path, *overrides: str) -> RunConfig:
    """The run of ``overrides`` (its output folder under ``tmp_path``, not created)."""
    return build_run_config(compose_config([f"clora.output_dir={tmp_path / 'out'}", *overrides]))
