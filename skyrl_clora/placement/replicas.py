"""Tenants spread over several replicas of the base model (``clora.replicas=K``), one Ray actor each.

A replica is what a one-replica run is: one base model with its engine, trainer and AdapterStore, running its
tenants concurrently (:func:`skyrl_clora.backends.embedded.backend.run_experiments`), kept open while the run goes so
that tenants move in and out of it (:mod:`.replica_actor`). The driver plans which replica starts which tenant
(:mod:`.planner`, by each tenant's work left: :func:`plan_replicas`), reserves one bundle per replica in a
Ray placement group (a GPU each on CUDA, a CPU each otherwise; a multi-node Ray cluster works the same way),
runs the replicas (:class:`.replica_set.ReplicaSet`: tenants moved between live replicas at step boundaries
when a replica runs out of tenants or when asked, lost replicas relaunched) and gathers the replicas' metrics
into the run's own files.

Every replica checkpoints into the run's checkpoint folder (``trainer.ckpt_path`` or
``<output_dir>/checkpoints``), so a tenant resumes on whichever replica takes it: a moved tenant from the
checkpoint its source wrote when it stopped (no step lost), a lost replica's tenants from their latest
checkpoints (only the steps since then lost); a replica lost more than
:data:`.replica_set.REPLICA_RESTARTS` times is given up and its unfinished tenants go on, from their latest
checkpoints, on the other live replicas (they fail only when none is left). Each replica writes its own metrics under ``<output_dir>/replicas/<k>/``; the run's ``metrics.jsonl``
(each tenant's records from the replica it ended on), ``summary.json`` (with the plan, ``replicas``, and the
``moves`` done) and ``adapters/<tenant>/`` gather them at the end. Live control (``python -m skyrl_clora.ctl``,
``clora.control``) works across replicas (:mod:`.replica_control`): tenants are added to the live replica with
room running the fewest, and stopped where they run.

A signal (Ctrl-C, SIGTERM) stops a replicated run as it stops a one-replica run (``interrupts``): the first is
forwarded to every replica, whose tenants stop after their current step (checkpointed, exported, a ``stopped``
record), and the run's files are written as above; a second ends the replicas at once (the metrics they logged
so far gathered, the last checkpoints what a resume continues from) and raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from skyrl_clora.base_model import resolve_device
from skyrl_clora.checkpoints import TenantCheckpoint, checkpoint_root, prepare_output_dir
from skyrl_clora.config.schema import ConfigError, RunConfig
from skyrl_clora.control.interrupts import STOP
from skyrl_clora.metrics import PoolOutcome
from skyrl_clora.placement.planner import estimated_cost, measured_costs, plan_assignment, step_seconds
from skyrl_clora.placement.replica_actor import ACTOR_CONCURRENCY, ReplicaRunner
from skyrl_clora.placement.replica_control import ReplicaControl
from skyrl_clora.placement.replica_set import REPLICA_RESTARTS, Move, ReplicaSet
from skyrl_clora.tenants import TenantSpec

__all__ = ["REPLICA_RESTARTS", "Move", "plan_replicas", "run_replicated"]

PLACEMENT_TIMEOUT_S = 120


def plan_replicas(run: RunConfig, specs: list[TenantSpec], resume: dict[str, TenantCheckpoint],
                  replicas: int) -> list[list[TenantSpec]]:
    """The tenants each of ``replicas`` replicas runs: :func:`plan_assignment` over their work left, at most
    ``clora.max_tenants`` per replica when set. A tenant's work left is its steps not yet checkpointed times its
    work per step: measured (the mean wall time of the steps its checkpoint's records hold) where it has run,
    else estimated (prompts x samples x positions per row; scaled to seconds by the tenants that ran, if any):
    :func:`~skyrl_clora.placement.planner.measured_costs`."""
    positions = run.recipe.max_input_length + run.recipe.max_generate_length
    per_step = [estimated_cost(spec.name, 1, run.recipe.prompts_per_step * spec.samples_per_prompt, positions)
                for spec in specs]
    steps_left = {spec.name: run.steps - (resume[spec.name].step if spec.name in resume else 0) for spec in specs}
    seconds = step_seconds(record for spec in specs if spec.name in resume for record in resume[spec.name].records)
    costs = measured_costs(per_step, steps_left, seconds)
    names = plan_assignment(costs, replicas, run.max_tenants or len(specs))
    by_name = {spec.name: spec for spec in specs}
    return [[by_name[name] for name in group] for group in names]


def run_replicated(run: RunConfig, resume: dict[str, TenantCheckpoint], stopped: list[str],
                   moves: Sequence[Move] = ()) -> PoolOutcome:
    """Runs the tenants of ``run`` not finished nor ``stopped`` on ``run.replicas`` replicas (see the module
    docstring), moving tenants as ``moves`` ask (replica indices in the plan's order: summary.json's
    ``replicas``) and where a replica runs out of tenants; writes the run's metrics.jsonl and adapters/; returns
    the run's records and summary fields for :func:`~skyrl_clora.metrics.summarize_pool`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from skyrl_gym.envs.registration import registry

    from skyrl_clora.placement.ray_session import start_ray, sync_skyrl_registries

    specs = [spec for spec in run.tenants if spec.name not in stopped
             and not (spec.name in resume and resume[spec.name].finished)]
    groups = [group for group in plan_replicas(run, specs, resume, run.replicas) if group]
    # A replica holds clora.max_tenants tenants, or (unset) its planned ones and one moved in.
    capacity = run.max_tenants or min(len(specs), max((len(group) for group in groups), default=0) + 1)
    root = checkpoint_root(run)
    envs = dict(registry)
    gpu = resolve_device(run).type == "cuda"
    sub_runs = [_replica_run(run, index, group, root, capacity) for index, group in enumerate(groups)]
    if not ray.is_initialized():
        start_ray(include_dashboard=False)
    # As SkyRL's initialize_ray: the driver makes (and so owns) the loss / estimator registries' named actors,
    # which replicas then sync with; made by a replica, they would die with it and fail the other replicas' steps.
    sync_skyrl_registries()
    STOP.reclaim()  # ray.init makes SIGTERM exit at once
    bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    for resource in bundle:
        held = int(ray.available_resources().get(resource, 0))
        if held < len(groups):
            raise ConfigError(f"clora.replicas={run.replicas} needs a {resource} per replica; the Ray cluster has "
                              f"{held} free: lower clora.replicas")
    group_pg = placement_group([bundle] * len(groups), strategy="PACK")
    try:
        ray.get(group_pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group_pg)
        raise ConfigError(f"Ray could not place {len(groups)} replicas ({bundle} each) within {PLACEMENT_TIMEOUT_S} s; "
                          "lower clora.replicas or free the cluster's resources") from None
    actor_class = ray.remote(ReplicaRunner)

    def launch(index: int, sub: RunConfig, own: dict[str, TenantCheckpoint]) -> Any:
        return _launch(actor_class, group_pg, index, gpu, sub, own, envs)

    replica_set = ReplicaSet(run, root, sub_runs, capacity, launch)
    control = ReplicaControl(run, replica_set, [spec.name for spec in run.tenants]) if run.control else None
    try:
        if control is not None:
            replica_set.serve_requests()
            control.start()
        replica_set.run_all(resume, list(moves))
        replica_set.close()
    except KeyboardInterrupt:  # a second signal
        replica_set.abort()
        _write_records(run, resume, stopped, sub_runs, replica_set)
        raise
    finally:
        if control is not None:
            replica_set.refuse_requests()
            control.close()
        remove_placement_group(group_pg)
    records = _write_records(run, resume, stopped, sub_runs, replica_set)
    fields = {"mode": run.mode, "steps": run.steps, "replicas": [[spec.name for spec in g] for g in groups],
              "moves": replica_set.moves}
    return PoolOutcome(records, fields, f"replicas={run.replicas}")


def _launch(actor_class: Any, group_pg: Any, index: int, gpu: bool, sub: RunConfig,
            resume: dict[str, TenantCheckpoint], envs: dict[str, Any]) -> Any:
    """Starts replica ``index``'s actor in its bundle on ``sub`` (from ``resume``); returns the actor."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=group_pg, placement_group_bundle_index=index)
    # The replica imports what the driver can (an environment registered from the driver's own modules).
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}}
    return actor_class.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy,
                               runtime_env=runtime_env, max_concurrency=ACTOR_CONCURRENCY).remote(sub, resume, envs)


def _replica_run(run: RunConfig, index: int, tenants: list[TenantSpec], root: Path, capacity: int) -> RunConfig:
    """Replica ``index``'s run: its start-time tenants, room for ``capacity``, its own output folder (created), the
    run's checkpoint folder, no control."""
    trainer = replace(run.trainer, ckpt_path=str(root))
    sub = replace(run, tenants=tuple(tenants), output_dir=run.output_dir / "replicas" / str(index), trainer=trainer,
                  replicas=1, control=False, max_tenants=capacity)
    prepare_output_dir(sub.output_dir)
    return sub


def _write_records(run: RunConfig, resume: dict[str, TenantCheckpoint], stopped: list[str], sub_runs: list[RunConfig],
                   replica_set: ReplicaSet) -> list[dict[str, Any]]:
    """Writes the run's metrics.jsonl (each tenant's records from the replica holding it last, then the driver's
    own) and gathers the replicas' exported adapters into adapters/; returns the records."""
    records = _stopped_records(run, resume, stopped)
    for index, sub in enumerate(sub_runs):
        held = {name for name, owner in replica_set.owner.items() if owner == index}
        records += [record for record in _read_records(sub.output_dir / "metrics.jsonl") if record.get("tenant") in held]
        _gather_adapters(sub.output_dir, run.output_dir, held)
    records += replica_set.records
    (run.output_dir / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return records


def _stopped_records(run: RunConfig, resume: dict[str, TenantCheckpoint], stopped: list[str]) -> list[dict[str, Any]]:
    """The records of tenants no replica ran (finished or stopped before), from their checkpoints."""
    return [record for spec in run.tenants if spec.name in resume and (resume[spec.name].finished or spec.name in stopped)
            for record in resume[spec.name].records]


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics log (a last line cut short by a replica ended mid-write left out)."""
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def _gather_adapters(replica_dir: Path, output_dir: Path, held: set[str]) -> None:
    """Moves the adapters the replica exported of the tenants in ``held`` to ``<output_dir>/adapters/<tenant>``."""
    source = replica_dir / "adapters"
    if not source.is_dir():
        return
    for folder in [folder for folder in source.iterdir() if folder.name in held]:
        target = output_dir / "adapters" / folder.name
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(folder), target)
