"""The run shell every command of ``skyrl_clora.main`` goes through: :func:`prepare` turns a command line into a
:class:`PreparedRun` in named phases, :func:`run_pool` runs its tenants on the chosen backend and writes the summary.

The phases of :func:`prepare`, in order (each refuses bad input with a :class:`~skyrl_clora.config.schema.ConfigError`
before the next starts; nothing is built or written before the last two):

1. :func:`compose_run`: SkyRL's command-line rewrites, the Hydra composition, unknown keys, the validated
   :class:`~skyrl_clora.config.schema.RunConfig`;
2. :func:`check_backend`: what the backend and the recipe refuse; ``backend=skyrl``'s plan and what this machine
   can build of it; a given model folder;
3. :func:`load_task_data`: every tenant's task data; enough rows for one step; the trackers;
4. :func:`build_base_model`: the base model (the tiny base is built here on first use), prompts over the length
   limit dropped, the steps planned;
5. :func:`claim_output`: the output folder made this run's (tenants added to a resumed run get their task data).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skyrl_clora.config.schema import ConfigError, RunConfig

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from skyrl_clora.backends.skyrl.config_translation import SkyRLPlan
    from skyrl_clora.checkpoints import TenantCheckpoint
    from skyrl_clora.recipes.plugin import TaskSource


@dataclass(frozen=True)
class PreparedRun:
    """A run ready to start: ``run`` (its steps planned, its output folder claimed), ``plan`` (``backend=skyrl``'s
    translated SkyRL config, else None), ``sources`` (task data by tenant name), ``resume`` (checkpoints to resume
    from by tenant), ``stopped`` (tenants stopped through the control endpoint in an earlier go), ``base_model_s``
    (seconds this command spent building the base model: 0 when given or cached) and ``before_claim`` (the output
    folder's entries before the claim, :func:`~skyrl_clora.checkpoints.output_entries`, to restore on a refusal)."""

    run: RunConfig
    plan: SkyRLPlan | None
    sources: dict[str, TaskSource]
    resume: dict[str, TenantCheckpoint]
    stopped: list[str]
    base_model_s: float
    before_claim: frozenset[str] | None


def compose_run(argv: list[str]) -> tuple[DictConfig, RunConfig, list[str]]:
    """Phase 1: the composed config of ``argv`` (after SkyRL's own rewrites of its command line and the presets a
    command naming its model implies), its :class:`RunConfig`, and the overrides as given (the keys
    ``backend=embedded`` judges are the user's own, not what the rewrites add)."""
    from skyrl_clora.config.build import build_run_config
    from skyrl_clora.config.compose import check_known_keys, compose_config
    from skyrl_clora.config.skyrl_cli import preset_overrides, skyrl_cli_overrides

    overrides = preset_overrides(skyrl_cli_overrides(argv))
    cfg = compose_config(overrides)
    check_known_keys(cfg, overrides)
    return cfg, build_run_config(cfg), overrides


def check_backend(cfg: DictConfig, run: RunConfig, given: list[str], overrides: list[str]) -> SkyRLPlan | None:
    """Phase 2: refuses what ``run.backend`` cannot honour of the user's ``given`` keys and what the recipe refuses;
    for ``backend=skyrl`` returns its SkyRL plan after checking that this machine can build it (else None); checks
    the model folder a command names."""
    from skyrl_clora.config.keys import check_embedded_keys, given_keys
    from skyrl_clora.recipes.plugin import load_recipe

    refusals = check_embedded_keys(cfg, given) if run.backend == "embedded" else []
    refusal = load_recipe(run.recipe.name).refuses(run.recipe, run.backend)
    if refusals or refusal:
        raise ConfigError("\n".join(refusals + ([refusal] if refusal else [])))
    plan = None
    if run.backend == "skyrl":
        from skyrl_clora.backends.skyrl.config_translation import translate
        from skyrl_clora.backends.skyrl.stack import check_buildable
        from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, tiny_base_path

        tiny_base = tiny_base_path(None, TinyBaseRecipe(corpus=run.model_corpus))
        plan = translate(cfg, model_path=run.model_path or str(tiny_base), given=given_keys(overrides))
        check_buildable(plan)
    if run.model_path is not None:
        from skyrl_clora.base_model import check_model_folder

        check_model_folder(run.model_path)
    return plan


def load_task_data(run: RunConfig) -> dict[str, TaskSource]:
    """Phase 3: every tenant's task data (by tenant name); refuses a training set too small for one step (dropping
    long prompts in phase 4 can only lower the count) and trackers that cannot start, before any model is built."""
    from skyrl_clora.config.build import planned_steps
    from skyrl_clora.recipes.plugin import build_task_sources
    from skyrl_clora.metrics import check_trackers

    sources = build_task_sources(run.recipe, list(run.tenants), run.max_training_steps, run.seed)
    planned_steps(run.epochs, run.max_training_steps, _fewest_rows(sources), run.recipe.prompts_per_step)
    check_trackers(run)
    return sources


def build_base_model(run: RunConfig, sources: dict[str, TaskSource]) -> tuple[RunConfig, dict[str, TaskSource], float]:
    """Phase 4: builds (on first use) or finds the base model; drops the prompts over ``trainer.max_prompt_length``
    as SkyRL does at load; returns the run with its steps planned for the rows left, the sources, and the seconds
    spent on the base model."""
    from skyrl_clora.base_model import prompt_tokenizer, resolve_model_path
    from skyrl_clora.config.build import plan_steps
    from skyrl_clora.recipes.plugin import drop_long_prompts

    started = time.perf_counter()
    resolve_model_path(run)
    base_model_s = time.perf_counter() - started
    tokenizer = prompt_tokenizer(run)
    sources = {name: drop_long_prompts(source, tokenizer, run.recipe.max_prompt_length, name)
               for name, source in sources.items()}
    return plan_steps(run, _fewest_rows(sources)), sources, base_model_s


def claim_output(run: RunConfig, sources: dict[str, TaskSource]) -> tuple[RunConfig, dict[str, TaskSource],
                                                                         dict[str, TenantCheckpoint], list[str],
                                                                         frozenset[str] | None]:
    """Phase 5: makes ``run.output_dir`` this run's (:func:`~skyrl_clora.checkpoints.claim_output_dir`); returns the
    run with the tenants added to it while it went, the sources with theirs, the checkpoints to resume from, the
    tenants stopped in an earlier go, and the folder's entries before the claim."""
    from skyrl_clora.base_model import prompt_tokenizer
    from skyrl_clora.checkpoints import claim_output_dir, output_entries
    from skyrl_clora.recipes.plugin import build_task_sources

    before_claim = output_entries(run.output_dir)
    run, resume, stopped = claim_output_dir(run)
    added = [spec for spec in run.tenants if spec.name not in sources]
    if added:
        sources = sources | build_task_sources(run.recipe, added, run.max_training_steps, run.seed,
                                               prompt_tokenizer(run))
    return run, sources, resume, stopped, before_claim


def prepare(argv: list[str]) -> PreparedRun:
    """The phases above, in order, for the command line ``argv`` (Hydra overrides); a
    :class:`~skyrl_clora.config.schema.ConfigError` for bad input."""
    cfg, run, overrides = compose_run(argv)
    plan = check_backend(cfg, run, argv, overrides)
    sources = load_task_data(run)
    run, sources, base_model_s = build_base_model(run, sources)
    run, sources, resume, stopped, before_claim = claim_output(run, sources)
    return PreparedRun(run, plan, sources, resume, stopped, base_model_s, before_claim)


def run_pool(prepared: PreparedRun) -> dict[str, Any]:
    """Runs the prepared run's tenants on its backend (SkyRL's stack, replicas of the embedded backend, or the
    embedded backend) through :func:`~skyrl_clora.metrics.summarize_pool`; returns the summary. A run refused
    once started (e.g. by the memory plan) leaves its output folder as it found it and raises the refusal."""
    from skyrl_clora.checkpoints import export_finished, release_refused_claim
    from skyrl_clora.metrics import summarize_pool

    run = prepared.run
    export_finished(run, prepared.resume)
    try:
        if run.backend == "skyrl":
            from skyrl_clora.backends.skyrl.backend import run_skyrl

            return summarize_pool(run, lambda: run_skyrl(run, prepared.plan, prepared.sources, prepared.resume,
                                                         prepared.stopped), prepared.base_model_s)
        if run.replicas > 1:
            from skyrl_clora.placement.replicas import run_replicated

            return summarize_pool(run, lambda: run_replicated(run, prepared.resume, prepared.stopped),
                                  prepared.base_model_s)
        from skyrl_clora.backends.embedded.backend import run_experiments

        return summarize_pool(run, lambda: run_experiments(run, prepared.sources, prepared.resume, prepared.stopped),
                              prepared.base_model_s)
    except ConfigError:
        release_refused_claim(run.output_dir, prepared.before_claim)
        raise


def _fewest_rows(sources: dict[str, TaskSource]) -> int:
    """The smallest training set of ``sources`` (the steps of every tenant are planned from it)."""
    return min(len(source.train_rows) for source in sources.values())

