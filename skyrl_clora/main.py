"""Entry point: ``python -m skyrl_clora.main [Hydra overrides]``, e.g. ``+tenants=8``.

The Hydra config tree in ``conf/`` is composed with Hydra's compose API (so that bad input gets a
one-line error and exit status 2 instead of a traceback), validated into a :class:`RunConfig` and run.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from skyrl_clora.interrupts import STOP

if TYPE_CHECKING:
    from skyrl_clora.checkpoints import TenantCheckpoint
    from skyrl_clora.config.schema import RunConfig
    from skyrl_clora.recipes.plugin import TaskSource
    from skyrl_clora.backends.skyrl.config_translation import SkyRLPlan

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

USAGE = """usage: python -m skyrl_clora.main [OVERRIDE ...]

Runs N RL experiments ("tenants") of one SkyRL recipe on one shared base model, each tenant its own
LoRA adapter. Overrides use Hydra syntax (key=value; +key=value adds a key).

Tenants:
  +tenants=N                       N tenants (seeds trainer.seed + i); default 1
  +tenants=[{{lr:1e-3}},{{seed:7,rank:8}}]  one tenant per entry; per-tenant keys:
                                   {overridable}
                                   (a tenant's trainer.seed, trainer.policy.optimizer_config.lr,
                                   trainer.policy.model.lora.rank/alpha, recipe.task_variant,
                                   generator.n_samples_per_prompt and environment.env_class; on
                                   backend=embedded also its sampling temperature and top_p, weight_decay,
                                   max_grad_norm and trainer.algorithm's kl_loss_coef, eps_clip_low/high,
                                   advantage_estimator, policy_loss_type)

Config groups (choose one of each):
{groups}

Settable keys, their defaults and what they do (a group's keys apply when the group option is chosen):
{keys}

Outputs in clora.output_dir: metrics.jsonl, summary.json, reward_curves.png, adapters/<tenant>/ (PEFT),
checkpoints/<tenant>/; the same command resumes a run in it. Live tenants: python -m skyrl_clora.ctl --help.
Exit status: 0 when no tenant failed; 1 when some failed (the others run on; their errors are in
summary.json); 3 when every tenant failed; 2 on bad input (before any work); 130 / 143 when SIGINT / SIGTERM
stopped the run (the same command resumes it).
Examples:
  python -m skyrl_clora.main +tenants=8
  python -m skyrl_clora.main +tenants=8 clora.mode=serial clora.output_dir=outputs/serial
  python -m skyrl_clora.main +tenants=4 trainer.policy.model.path=/models/Qwen3-0.6B environment.env_class=gsm8k \
      data.train_data="['~/data/gsm8k/train.parquet']" data.val_data="['~/data/gsm8k/validation.parquet']"
SkyRL's own keys (data.*, trainer.*, generator.*, environment.*) keep SkyRL's meaning; docs/config.md says where
each acts on each backend (backend=embedded refuses what it cannot honour).
"""


class UserError(Exception):
    """Bad input: printed as one line, exit status 2."""


def _groups() -> str:
    lines = []
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        lines.append(f"  {group.name}={'|'.join(options)}")
    return "\n".join(lines)


def compose_config(overrides: list[str]):
    """Composes conf/ (SkyRL's key tree included) with ``overrides``; Hydra/OmegaConf errors become
    :class:`UserError`."""
    from skyrl_clora.config.keys import register_skyrl_defaults

    register_skyrl_defaults()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        message = str(error).strip().splitlines()[0]
        missing_group = re.search(r"Could not find '(\w+)/", message)
        if missing_group and (CONF_DIR / missing_group.group(1)).is_dir():
            options = sorted(f.stem for f in (CONF_DIR / missing_group.group(1)).glob("*.yaml"))
            message += f"; choose {missing_group.group(1)}= one of {', '.join(options)}"
        if "tenants" in message and "+tenants" not in " ".join(overrides):
            message += " (write +tenants=N: tenants is added with a leading '+')"
        unknown = re.search(r"Could not override '([\w.]+)'", message)
        if unknown and unknown.group(1) != "tenants":
            message = _unknown_key_message(unknown.group(1), overrides)
        raise UserError(message) from None


def _unknown_key_message(key: str, overrides: list[str]) -> str:
    """One line for an override of a key the config does not have: the closest valid keys."""
    import difflib

    from skyrl_clora.config.build import flat_config

    known = list(flat_config(_group_defaults(overrides)))
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else "see python -m skyrl_clora.main --help for the keys"
    return f"unknown key {key}; {hint} (a key the config does not have is added with +key=value)"


def _group_defaults(overrides: list[str]) -> DictConfig:
    """The config composed with the group choices of ``overrides`` alone (``recipe=``, ``backend=``, ...): every key
    with its default. Read-only; composed once per set of choices."""
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    return _composed_defaults(tuple(o for o in overrides if o.split("=", 1)[0] in groups))


@functools.cache
def _composed_defaults(choices: tuple[str, ...]) -> DictConfig:
    cfg = compose_config(list(choices))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def check_known_keys(cfg: DictConfig, overrides: list[str]) -> None:
    """Raises :class:`UserError` for a key that ``+key=value`` added and nothing reads: every key of ``cfg`` but
    ``tenants`` must be in the config composed with the same group choices alone (``recipe=``, ``backend=``, ...),
    which holds SkyRL's whole key tree."""
    from skyrl_clora.config.keys import FREE_FORM_KEYS

    defaults = _group_defaults(overrides)

    def walk(node: DictConfig, known: DictConfig, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            if path == "tenants":
                continue
            if key not in known:
                valid = ", ".join(sorted(str(k) for k in known))
                raise UserError(f"unknown key {path}; valid keys{' here' if prefix else ''}: {valid}")
            if OmegaConf.is_dict(node[key]) and OmegaConf.is_dict(known[key]) and path not in FREE_FORM_KEYS:
                walk(node[key], known[key], f"{path}.")

    walk(cfg, defaults, "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        from skyrl_clora.config.help import help_text
        from skyrl_clora.tenants import OVERRIDABLE

        print(USAGE.format(groups=_groups(), keys=help_text(CONF_DIR), overridable=", ".join(OVERRIDABLE)))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from skyrl_clora.checkpoints import claim_output_dir, output_entries
    from skyrl_clora.config.schema import ConfigError
    from skyrl_clora.config.build import build_run_config, plan_steps
    from skyrl_clora.config.keys import check_embedded_keys
    from skyrl_clora.recipes.plugin import build_task_sources, drop_long_prompts, load_recipe
    from skyrl_clora.trackers import check_trackers

    try:
        from skyrl_clora.config.skyrl_cli import preset_overrides, skyrl_cli_overrides

        given = argv  # the user's own overrides: backend=embedded judges these, not what the rewrites add
        argv = skyrl_cli_overrides(argv)  # SkyRL's own rewrites of its command line (async_engine=true, ...)
        argv = preset_overrides(argv)  # a command naming its model: SkyRL's defaults (preset=skyrl)
        cfg = compose_config(argv)
        check_known_keys(cfg, argv)
        run = build_run_config(cfg)
        refusals = check_embedded_keys(cfg, given) if run.backend == "embedded" else []
        refusal = load_recipe(run.recipe.name).refuses(run.recipe, run.backend)
        if refusals or refusal:
            raise ConfigError("\n".join(refusals + ([refusal] if refusal else [])))
        plan = None
        if run.backend == "skyrl":
            from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, tiny_base_path
            from skyrl_clora.backends.skyrl.config_translation import translate
            from skyrl_clora.backends.skyrl.stack import check_buildable

            # SkyRL's constraints and what this machine can build, checked before anything starts.
            from skyrl_clora.config.keys import given_keys

            tiny_base = tiny_base_path(None, TinyBaseRecipe(corpus=run.model_corpus))
            plan = translate(cfg, model_path=run.model_path or str(tiny_base), given=given_keys(argv))
            check_buildable(plan)
        if run.model_path is not None:
            from skyrl_clora.base_model import check_model_folder

            check_model_folder(run.model_path)
        sources = build_task_sources(run.recipe, list(run.tenants), run.max_training_steps, run.seed)  # before the model
        plan_steps(run, min(len(source.train_rows) for source in sources.values()))  # too few rows: refused before the
        # model is built (dropping long prompts below can only lower the count; the steps are planned after it)
        check_trackers(run)  # after the input checks, before the model is built or loaded
        from skyrl_clora.base_model import prompt_tokenizer, resolve_model_path

        base_started = time.perf_counter()
        resolve_model_path(run)  # the tiny base is built here on first use: the summary reports this command's build
        base_model_s = time.perf_counter() - base_started
        tokenizer = prompt_tokenizer(run)  # SkyRL drops prompts over trainer.max_prompt_length at load: so do we
        sources = {name: drop_long_prompts(source, tokenizer, run.recipe.max_prompt_length, name)
                   for name, source in sources.items()}
        run = plan_steps(run, min(len(source.train_rows) for source in sources.values()))
        before_claim = output_entries(run.output_dir)
        run, resume, stopped = claim_output_dir(run)
        added = [spec for spec in run.tenants if spec.name not in sources]  # joined the resumed run while it went
        sources |= build_task_sources(run.recipe, added, run.max_training_steps, run.seed, tokenizer)
    except (UserError, ConfigError) as error:
        return _refused(error)
    with STOP.installed():
        return _run(run, plan, sources, resume, stopped, base_model_s, before_claim)


def _run(run: RunConfig, plan: SkyRLPlan | None, sources: dict[str, TaskSource],
         resume: dict[str, TenantCheckpoint], stopped: list[str], base_model_s: float,
         before_claim: frozenset[str] | None) -> int:
    """Runs the validated ``run`` on its backend (its base model built already, in ``base_model_s`` seconds: 0 when
    given or cached); the exit status (see :func:`_exit_status`). A run refused once started (e.g. by the memory plan)
    leaves its output folder as it found it (``before_claim``: :func:`~skyrl_clora.checkpoints.output_entries`)."""
    from skyrl_clora.checkpoints import checkpoint_root, export_finished, release_refused_claim
    from skyrl_clora.config.schema import ConfigError

    export_finished(run, resume)
    try:
        try:
            if run.backend == "skyrl":
                from skyrl_clora.backends.skyrl.backend import run_skyrl

                summary = run_skyrl(run, plan, sources, resume, stopped, base_model_s)
            elif run.replicas > 1:
                from skyrl_clora.placement.replicas import run_replicated

                summary = run_replicated(run, resume, stopped, base_model_s)
            else:
                from skyrl_clora.backends.embedded.backend import run_experiments

                summary = run_experiments(run, sources, resume, stopped, base_model_s)
        except ConfigError as error:
            release_refused_claim(run.output_dir, before_claim)
            return _refused(error)
        return _exit_status(summary, run.output_dir)
    except KeyboardInterrupt:  # a second signal: abandoned at once
        print(f"[stop] aborted; the tenants' last checkpoints are under {checkpoint_root(run)}", file=sys.stderr)
        return STOP.exit_status() or 130


def _refused(error: Exception) -> int:
    """Prints bad input, one ``error:`` line per problem; the exit status 2."""
    for problem in str(error).splitlines():
        print(f"error: {problem}", file=sys.stderr)
    return 2


def _exit_status(summary: dict[str, Any], output_dir: Path) -> int:
    """128 + the signal's number if a signal stopped the run (``interrupts``); else 0 if no tenant of the run
    ``summary`` failed (each finished, or was stopped through the control endpoint); else 1 when some tenants
    failed and 3 when every one did, after a line on stderr naming the failed tenants."""
    rows = summary["per_tenant"]
    if STOP.requested():
        print(f"[stop] stopped; the same command resumes the run in {output_dir}", file=sys.stderr)
        return STOP.exit_status()
    failed = [row["tenant"] for row in rows if row["status"] == "failed"]
    if not failed:
        return 0
    print(f"error: {len(failed)} of {len(rows)} tenants failed ({', '.join(failed)}); their errors are in "
          f"{output_dir / 'summary.json'}", file=sys.stderr)
    return 3 if len(failed) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
