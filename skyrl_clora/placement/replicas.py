"""Tenants spread over several replicas of the base model (``clora.replicas=K``), one Ray actor each.

A replica is what a one-replica run is: one base model with its engine, trainer and AdapterStore, running its
tenants concurrently (:func:`skyrl_clora.backends.embedded.run_experiments`). The driver plans which replica
runs which tenant (:mod:`.planner`, by each tenant's work left: steps x rows x positions), reserves one bundle
per replica in a Ray placement group (a GPU each on CUDA, a CPU each otherwise; a multi-node Ray cluster
works the same way), and gathers the replicas' metrics into the run's own files.

Every replica checkpoints into the run's checkpoint folder (``trainer.ckpt_path`` or
``<output_dir>/checkpoints``), so a tenant resumes on whichever replica the plan gives it. A replica that dies
(its actor lost) costs its tenants only the steps since their last checkpoint: a new replica takes them and
resumes them from there; one lost more than :data:`REPLICA_RESTARTS` times leaves its unfinished tenants failed,
the other replicas' tenants unharmed. Each replica writes its own metrics under ``<output_dir>/replicas/<k>/``; the run's
``metrics.jsonl``, ``summary.json`` and ``adapters/<tenant>/`` gather them at the end. Live control
(``python -m skyrl_clora.ctl``) is not available across replicas.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from skyrl_clora.checkpoints import TenantCheckpoint, TenantCheckpoints, checkpoint_root, run_tenants
from skyrl_clora.config import ConfigError, RunConfig
from skyrl_clora.metrics import write_run_summary
from skyrl_clora.placement.planner import estimated_cost, plan_assignment
from skyrl_clora.services import resolve_device
from skyrl_clora.tenants import TenantSpec

PLACEMENT_TIMEOUT_S = 120
REPLICA_RESTARTS = 2  # a replica lost more often than this leaves its unfinished tenants failed (the others go on)


class ReplicaRunner:
    """The body of one replica's Ray actor: runs its tenants as a one-replica run would."""

    def run(self, run: RunConfig, resume: dict[str, TenantCheckpoint], envs: dict[str, Any]) -> dict[str, Any]:
        """Registers the driver's skyrl-gym environments ``envs`` (id -> EnvSpec) this process lacks, builds the
        tenants' task data (which registers the recipe's environment here) and runs them; returns the summary."""
        from skyrl_gym.envs.registration import register, registry

        from skyrl_clora.backends.embedded import run_experiments
        from skyrl_clora.recipes.plugin import build_task_sources
        from skyrl_clora.services import prompt_tokenizer

        for env_id, spec in envs.items():
            if env_id not in registry:
                register(env_id, entry_point=spec.entry_point, kwargs=spec.kwargs)
        sources = build_task_sources(run.recipe, list(run.tenants), run.max_training_steps, run.seed,
                                     prompt_tokenizer(run))
        return run_experiments(run, sources, resume, [])


def plan_replicas(run: RunConfig, specs: list[TenantSpec], resume: dict[str, TenantCheckpoint],
                  replicas: int) -> list[list[TenantSpec]]:
    """The tenants each of ``replicas`` replicas runs: :func:`plan_assignment` over their work left (steps not
    yet checkpointed x prompts x samples x positions per row), at most ``clora.max_tenants`` per replica when set."""
    positions = run.recipe.max_input_length + run.recipe.max_generate_length
    costs = [estimated_cost(spec.name, run.steps - (resume[spec.name].step if spec.name in resume else 0),
                            run.recipe.prompts_per_step * spec.samples_per_prompt, positions) for spec in specs]
    names = plan_assignment(costs, replicas, run.max_tenants or len(specs))
    by_name = {spec.name: spec for spec in specs}
    return [[by_name[name] for name in group] for group in names]


def run_replicated(run: RunConfig, resume: dict[str, TenantCheckpoint], stopped: list[str]) -> dict[str, Any]:
    """Runs the tenants of ``run`` not finished nor ``stopped`` on ``run.replicas`` replicas (see the module
    docstring); writes the run's metrics.jsonl, summary.json and adapters/; returns the summary."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from skyrl_gym.envs.registration import registry

    started = time.perf_counter()
    specs = [spec for spec in run.tenants if spec.name not in stopped
             and not (spec.name in resume and resume[spec.name].finished)]
    groups = [group for group in plan_replicas(run, specs, resume, run.replicas) if group]
    root = checkpoint_root(run)
    envs = dict(registry)
    gpu = resolve_device(run).type == "cuda"
    sub_runs = [_replica_run(run, index, group, root) for index, group in enumerate(groups)]
    if not ray.is_initialized():
        ray.init(include_dashboard=False)
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
    records: list[dict[str, Any]] = []
    losses, lost = [0] * len(sub_runs), []
    try:
        pending = {}
        for index, sub in enumerate(sub_runs):
            pending[_launch(actor_class, group_pg, index, gpu, sub, resume, envs)] = index
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(done[0])
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as error:  # the replica died: its tenants resume from checkpoints
                losses[index] += 1
                if losses[index] > REPLICA_RESTARTS:
                    print(f"[replicas] replica {index} was lost {losses[index]} times; its unfinished tenants fail",
                          file=sys.stderr)
                    lost += _lost_records(root, sub_runs[index].tenants, f"{type(error).__name__}: replica lost "
                                          f"{losses[index]} times")
                    continue
                print(f"[replicas] replica {index} was lost; its tenants resume from their last checkpoints",
                      file=sys.stderr)
                latest = _latest_checkpoints(root, sub_runs[index].tenants)
                pending[_launch(actor_class, group_pg, index, gpu, sub_runs[index], latest, envs)] = index
    finally:
        remove_placement_group(group_pg)
    for sub in sub_runs:
        records += _read_records(sub.output_dir / "metrics.jsonl")
        _gather_adapters(sub.output_dir, run.output_dir)
    records = _stopped_records(run, resume, stopped) + records + lost
    (run.output_dir / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    fields = {"mode": run.mode, "steps": run.steps, "replicas": [[spec.name for spec in g] for g in groups]}
    return write_run_summary(run.output_dir, records, run_tenants(run), fields, time.perf_counter() - started, 0.0,
                             f"replicas={run.replicas}")


def _launch(actor_class: Any, group_pg: Any, index: int, gpu: bool, sub: RunConfig,
            resume: dict[str, TenantCheckpoint], envs: dict[str, Any]) -> Any:
    """Starts replica ``index``'s actor in its bundle and its run; returns the run's object ref."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=group_pg, placement_group_bundle_index=index)
    # The replica imports what the driver can (an environment registered from the driver's own modules).
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}}
    actor = actor_class.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy,
                                runtime_env=runtime_env).remote()
    own = {name: checkpoint for name, checkpoint in resume.items() if name in {s.name for s in sub.tenants}}
    return actor.run.remote(sub, own, envs)


def _replica_run(run: RunConfig, index: int, tenants: list[TenantSpec], root: Path) -> RunConfig:
    """Replica ``index``'s run: its tenants, its own output folder, the run's checkpoint folder, no control."""
    trainer = replace(run.trainer, ckpt_path=str(root))
    return replace(run, tenants=tuple(tenants), output_dir=run.output_dir / "replicas" / str(index), trainer=trainer,
                   replicas=1, control=False, max_tenants=0)


def _latest_checkpoints(root: Path, specs: tuple[TenantSpec, ...]) -> dict[str, TenantCheckpoint]:
    found = {spec.name: TenantCheckpoints(root, spec.name, -1).latest() for spec in specs}
    return {name: checkpoint for name, checkpoint in found.items() if checkpoint is not None}


def _lost_records(root: Path, specs: tuple[TenantSpec, ...], error: str) -> list[dict[str, Any]]:
    """A failure record for each of ``specs`` whose latest checkpoint is not its last (it did not finish)."""
    latest = _latest_checkpoints(root, specs)
    return [{"event": "failed", "tenant": spec.name, "error": error}
            for spec in specs if not (spec.name in latest and latest[spec.name].finished)]


def _stopped_records(run: RunConfig, resume: dict[str, TenantCheckpoint], stopped: list[str]) -> list[dict[str, Any]]:
    """The records of tenants no replica ran (finished or stopped before), from their checkpoints."""
    return [record for spec in run.tenants if spec.name in resume and (resume[spec.name].finished or spec.name in stopped)
            for record in resume[spec.name].records]


def _read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _gather_adapters(replica_dir: Path, output_dir: Path) -> None:
    """Moves the replica's exported adapters to ``<output_dir>/adapters/<tenant>``."""
    source = replica_dir / "adapters"
    if not source.is_dir():
        return
    for folder in source.iterdir():
        target = output_dir / "adapters" / folder.name
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(folder), target)
