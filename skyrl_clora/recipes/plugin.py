"""Recipes are plugins. A recipe is one folder ``skyrl_clora/recipes/<name>/`` whose package exposes
``RECIPE`` (a :class:`Recipe`: the skyrl-gym env classes it serves, its own config keys, the tenant's task data,
its environment's registration, the extra arguments of its episodes, the backends it refuses) plus one config
file ``conf/recipe/<name>.yaml`` of defaults (``recipe=<name>`` picks them); SkyRL's ``environment.env_class``
selects the recipe that serves it. Nothing outside a recipe's folder names it. A recipe may also be a
:class:`PretrainingCorpus`: the synthetic episodes a base model is pre-trained on (``model.corpus`` names it).

A recipe whose ``env_classes`` hold :data:`ANY_REGISTERED_ENV` serves every env class registered with skyrl-gym
that no other recipe serves.

Task data is per tenant: SkyRL dataset rows for each RL step and for evaluation. A row is what SkyRL's prompt
dataset yields: ``{"prompt": [messages], "env_class": str | None, ...extras}``; every key other than ``prompt`` and
``env_class`` is passed to the environment as its ``extras``. A row runs in the env its tenant's ``env_class``
override names, else (SkyRL's rule) in its own ``env_class`` when it has one, else in ``environment.env_class``.
"""

from __future__ import annotations

import importlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from skyrl_clora.config.schema import ConfigError, RecipeConfig
from skyrl_clora.tenants import TenantSpec

EVAL_SEED_OFFSET = 1_000_003
ANY_REGISTERED_ENV = "*"
"""In a recipe's ``env_classes``: every env class registered with skyrl-gym that no other recipe serves."""
logger = logging.getLogger("skyrl_clora")


@dataclass
class TaskSource:
    """Training rows drawn per step with the tenant's seed (without replacement, reshuffled per epoch) and a
    fixed evaluation set shared by all tenants of a run. Each row runs in :meth:`env_of` it: ``tenant_env_class``
    (the tenant's ``env_class`` override) when set, else the row's own ``env_class``, else ``env_class``
    (``environment.env_class``)."""

    env_class: str
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    seed: int
    tenant_env_class: str | None = None

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

    def env_of(self, row: dict[str, Any]) -> str:
        """The env class ``row`` runs in (see the class docstring; SkyRL's ``prepare_generator_input`` rule)."""
        if self.tenant_env_class is not None:
            return self.tenant_env_class
        return row["env_class"] if row.get("env_class") is not None else self.env_class

    def env_classes(self) -> set[str]:
        """Every env class the training and evaluation rows run in."""
        return {self.env_of(row) for row in [*self.train_rows, *self.eval_rows]}

    def _with_env(self, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "env_class": self.env_of(row)}


# The sampler's base model (no adapter) answering a chat: (messages, max_tokens, user id) -> reply text.
ChatFunction = Callable[[list[dict[str, str]], int, str], Awaitable[str]]


@dataclass(frozen=True)
class EpisodeEnv:
    """What a tenant's episodes get besides their row: ``args`` added to every episode's env extras, and
    ``workers`` for SkyRL's generator (environment steps run off the event loop when > 0)."""

    args: dict[str, Any] = field(default_factory=dict)
    workers: int = 0


class Recipe(Protocol):
    """A recipe plugin (see the module docstring). ``options_type`` is a frozen dataclass of the recipe's own
    keys under ``recipe.`` (beside :class:`RecipeConfig`'s), with their defaults; its ``__post_init__`` raises
    :class:`ConfigError` on bad values. The built options are ``RecipeConfig.options``."""

    env_classes: tuple[str, ...]
    options_type: type

    def task_source(self, config: RecipeConfig, spec: TenantSpec, max_steps: int | None, run_seed: int) -> TaskSource:
        """The tenant's task data (synthetic training rows: enough for ``max_steps`` steps when given); registers
        the recipe's skyrl-gym environment."""

    def episode_env(self, config: RecipeConfig, spec: TenantSpec, chat: ChatFunction | None) -> EpisodeEnv:
        """The extras of the tenant's episodes; ``chat`` is None where the backend offers none. Nothing in them
        may depend on the tenant's name (only on what defines its experiment, e.g. its seed)."""

    def refuses(self, config: RecipeConfig, backend: str) -> str | None:
        """Why ``backend`` (embedded or skyrl) cannot run ``config``, as the fix to make; None when it can."""


# An assistant turn of a pre-training episode: (assistant text, the observations that follow it).
Turn = tuple[str, list[dict[str, str]]]
# A pre-training episode: (prompt messages, turns).
Episode = tuple[list[dict[str, str]], list[Turn]]


@dataclass(frozen=True)
class CorpusSettings:
    """What a pre-training corpus is drawn with: ``count`` episodes, a fraction ``hard_fraction`` of them from
    the recipe's "hard" task variant, seeded by ``seed``."""

    count: int
    hard_fraction: float
    seed: int


class PretrainingCorpus(Protocol):
    """A recipe that can make a base model's pre-training episodes."""

    def pretraining_episodes(self, settings: CorpusSettings, solve_rate: float) -> list[Episode]:
        """``settings.count`` episodes, each solving its task the way RL should learn to with probability
        ``solve_rate`` (and failing plausibly otherwise), deterministic in ``settings`` and ``solve_rate``."""


def recipe_folders() -> list[str]:
    """The recipes of this install: the package folders beside this module that expose ``RECIPE``."""
    root = Path(__file__).parent
    return sorted(p.name for p in root.iterdir() if (p / "recipe.py").is_file())


def load_recipe(name: str) -> Recipe:
    """The ``RECIPE`` of folder ``name``; an unknown name is a :class:`ConfigError` listing the recipes."""
    if name not in recipe_folders():
        raise ConfigError(f"recipe={name} is unknown; use one of {', '.join(recipe_folders())}")
    return importlib.import_module(f"skyrl_clora.recipes.{name}.recipe").RECIPE


def recipe_for_env(env_class: str) -> str:
    """The recipe folder whose ``env_classes`` hold ``env_class``, else, for an env class registered with skyrl-gym,
    the one holding :data:`ANY_REGISTERED_ENV`; else a :class:`ConfigError` listing the recipes' env classes."""
    import skyrl_gym

    served = {env: folder for folder in recipe_folders() for env in load_recipe(folder).env_classes}
    if env_class in served:
        return served[env_class]
    if ANY_REGISTERED_ENV in served and isinstance(env_class, str) and env_class in skyrl_gym.registry:
        return served[ANY_REGISTERED_ENV]
    named = ", ".join(f"{env} ({folder})" for env, folder in sorted(served.items()) if env != ANY_REGISTERED_ENV)
    raise ConfigError(f"environment.env_class={env_class} has no recipe here and is not registered with skyrl-gym; use "
                      f"one of {named}, or an env registered with skyrl_gym.register before the run")


def load_corpus(name: str) -> PretrainingCorpus:
    """The recipe ``name`` as a :class:`PretrainingCorpus`; a :class:`ConfigError` naming ``model.corpus`` and the
    recipes that offer one when it is no such recipe."""
    offering = [folder for folder in recipe_folders() if hasattr(load_recipe(folder), "pretraining_episodes")]
    if name not in offering:
        raise ConfigError(f"model.corpus={name} is no recipe with a pre-training corpus; use one of {', '.join(offering)}")
    return load_recipe(name)


def load_skyrl_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a SkyRL-format parquet file as SkyRL's PromptDataset yields them (unchanged); a row without a chat
    ``prompt`` (a non-empty list of messages) is a ValueError naming it."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"parquet file not found: {path}")
    rows = pq.read_table(path).to_pylist()
    for index, row in enumerate(rows):
        if not isinstance(row.get("prompt"), list) or not row["prompt"]:
            raise ValueError(f"row {index} has no chat prompt (a list of messages)")
    return rows


def read_parquet_files(paths: tuple[str, ...], key: str,
                       load: Callable[[str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of every file of ``paths`` (config key ``key``: ``data.train_data`` or ``data.val_data``) read by
    ``load``, concatenated; a file ``load`` cannot read, or files that hold no row, are a :class:`ConfigError`
    naming ``key``."""
    rows = []
    for path in paths:
        try:
            rows.extend(load(path))
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}: {path}: {error}; point it at a parquet file in SkyRL's dataset schema (e.g. from "
                              "SkyRL's example dataset scripts)") from None
    if paths and not rows:
        raise ConfigError(f"{key}={list(paths)} holds no rows; check the files")
    return rows


def drop_long_prompts(source: TaskSource, tokenizer: Any, max_prompt_length: int, tenant: str) -> TaskSource:
    """``source`` without the rows whose prompt is longer than ``max_prompt_length`` tokens with the chat template
    and generation prompt applied: SkyRL's ``PromptDataset`` rule (its ``_prompt_not_too_long``), applied as it
    does to the training and the evaluation data, with a log line when rows go. No training row left is a one-line
    :class:`ConfigError`."""
    from skyrl.train.dataset.dataset import _prompt_not_too_long

    kept = {}
    for part in ("train_rows", "eval_rows"):
        rows = getattr(source, part)
        kept[part] = [row for row in rows if _prompt_not_too_long(row, tokenizer, "prompt", max_prompt_length)]
        if len(kept[part]) < len(rows):
            logger.warning("tenant %s: dropped %d of %d %s rows whose prompt is longer than trainer.max_prompt_length=%d "
                           "tokens (SkyRL's rule: chat template included)", tenant, len(rows) - len(kept[part]),
                           len(rows), "training" if part == "train_rows" else "evaluation", max_prompt_length)
    if not kept["train_rows"]:
        raise ConfigError(f"tenant {tenant}: every training prompt is longer than trainer.max_prompt_length="
                          f"{max_prompt_length} tokens (chat template included); raise trainer.max_prompt_length")
    return replace(source, **kept)


def build_task_sources(recipe: RecipeConfig, specs: list[TenantSpec], max_steps: int | None,
                       run_seed: int, tokenizer: Any | None = None) -> dict[str, TaskSource]:
    """Every tenant's data, by tenant name, built before anything else starts: data that cannot be read, an
    unknown task variant or an environment that skyrl-gym does not know is a one-line :class:`ConfigError`
    (exit status 2), not a tenant failing once the run is under way. With the base model's ``tokenizer``, rows
    whose prompt exceeds ``trainer.max_prompt_length`` are dropped as SkyRL drops them (:func:`drop_long_prompts`)."""
    import skyrl_gym

    plugin = load_recipe(recipe.name)
    sources = {}
    for spec in specs:
        try:
            source = plugin.task_source(recipe, spec, max_steps, run_seed)
        except ValueError as error:  # a ConfigError, or e.g. an unknown task variant
            raise ConfigError(f"tenant {spec.name}: {error}") from None
        unknown = sorted(env for env in source.env_classes() if env not in skyrl_gym.registry)
        if unknown:
            raise ConfigError(f"tenant {spec.name}: env_class={unknown[0]} is not a registered skyrl-gym "
                              f"environment; register it before the run, or leave env_class to the recipe")
        if tokenizer is not None:
            source = drop_long_prompts(source, tokenizer, recipe.max_prompt_length, spec.name)
        sources[spec.name] = source
    return sources
