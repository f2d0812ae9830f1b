"""Entry point: ``python -m skyrl_clora.main [Hydra overrides]``, e.g. ``+tenants=8``.

This module is the command line only: the usage text, ``--help`` and the exit statuses. What a run does is
:mod:`skyrl_clora.run_shell`'s (prepare in named phases, run the tenant pool, write the summary).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from skyrl_clora.control.interrupts import STOP

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


def main(argv: list[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``): ``--help`` prints the usage; else the run is
    prepared and run (:mod:`skyrl_clora.run_shell`). Returns the exit status (see :data:`USAGE`)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        from skyrl_clora.config.compose import CONF_DIR, config_groups
        from skyrl_clora.config.help import help_text
        from skyrl_clora.tenants import OVERRIDABLE

        print(USAGE.format(groups=config_groups(), keys=help_text(CONF_DIR), overridable=", ".join(OVERRIDABLE)))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from skyrl_clora.checkpoints import checkpoint_root
    from skyrl_clora.config.schema import ConfigError
    from skyrl_clora.run_shell import prepare, run_pool

    try:
        prepared = prepare(argv)
    except ConfigError as error:
        return _refused(error)
    with STOP.installed():
        try:
            return _exit_status(run_pool(prepared), prepared.run.output_dir)
        except ConfigError as error:  # refused once started (e.g. by the memory plan); the folder left as found
            return _refused(error)
        except KeyboardInterrupt:  # a second signal: abandoned at once
            print(f"[stop] aborted; the tenants' last checkpoints are under {checkpoint_root(prepared.run)}",
                  file=sys.stderr)
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
