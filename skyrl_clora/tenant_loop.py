"""The tenant loop, written once for both backends: SkyRL's RL step parameterised by a tenant.

A tenant's experiment is: register its adapter; evaluate; ``steps`` times sample the step's episodes,
check they were sampled with the tenant's current adapter version, train on them and publish the new
version (checkpointing every ``trainer.ckpt_interval`` steps); evaluate again; export the adapter (PEFT
format) and checkpoint it as finished. A tenant resumed from a checkpoint (``checkpoints``) continues after
its last checkpointed step; a finished one is not run again. When the run is asked to stop
(``control.interrupts.STOP``), each tenant stops after its current step: it checkpoints, exports and records a
``stopped`` event. A tenant that raises (e.g. its reward function, a stale trajectory) is recorded as failed
and removed; the other tenants run on.

The loop talks to the shared services through a :class:`TenantBackend`: ``backends.embedded`` (the
project's engine, AdapterStore trainer and in-place sync) and ``backends.skyrl`` (SkyRL's generator,
``WorkerDispatch`` and policy workers) implement it. Everything a tenant's life needs (checkpoints, joining
and leaving, trackers) is written here once. A :class:`TenantPool` runs the tenants of one set of services, and
:func:`run_tenant_pool` runs a pool with the control endpoint (``control``) for the backends.
Both backends build their episode batches (:func:`episode_batch`) and the records of metrics.jsonl
(:func:`step_record`, :func:`eval_record`) with the functions at the end of this module.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.train.config import SamplingParams
from skyrl.train.generators.base import GeneratorInput, TrajectoryID
from skyrl.train.generators.utils import get_metrics_from_generator_output

from skyrl_clora.checkpoints import TenantCheckpoint, TenantCheckpoints, checkpoint_root
from skyrl_clora.config.schema import ConfigError, RunConfig
from skyrl_clora.control.interrupts import STOP
from skyrl_clora.control.server import ControlServer
from skyrl_clora.metrics import MetricsLog
from skyrl_clora.recipes.plugin import TaskSource
from skyrl_clora.tenants import TenantSpec

logger = logging.getLogger("skyrl_clora")


@dataclass
class Rollout:
    """A batch of a tenant's episodes: SkyRL's generator output (``prompt_token_ids``, ``response_ids``,
    ``loss_masks``, ``rewards``, ...), each episode's GRPO group id and trajectory id, and per trajectory the
    adapter version each of its requests was sampled with."""

    output: dict[str, Any]
    groups: list[str]
    trajectory_ids: list[TrajectoryID]
    versions: list[list[int]]


@dataclass
class Update:
    """A tenant's policy update, as :meth:`TenantBackend.train` returns it and :meth:`TenantBackend.publish` takes
    it: the trainer's metrics and the backend's handle on the trained adapter (the embedded trainer's
    :class:`~skyrl_clora.lora.layers.AdapterWeights`; None on backend=skyrl, whose workers hold the weights and
    write them out when told to sync)."""

    metrics: dict[str, float]
    weights: Any = None


class TenantBackend(Protocol):
    """The shared sampler, trainer and sync as one tenant loop sees them (every call names its tenant)."""

    async def register(self, spec: TenantSpec) -> None:
        """Creates the tenant's adapter (seeded init, its LR schedule and RNG) and publishes it as version 0."""

    async def sample(self, spec: TenantSpec, rows: list[dict[str, Any]], samples: int, tag: str,
                     sampling_params: dict[str, Any] | None = None) -> Rollout:
        """Runs ``samples`` episodes of each dataset row with the tenant's adapter (GRPO groups ``<tenant>-<tag>-p<i>``)
        with ``sampling_params`` (vLLM's format, as SkyRL's ``get_sampling_params_for_backend`` makes them) or, when
        None, the tenant's training sampling params."""

    def version(self, tenant: str) -> int:
        """The tenant's published adapter version (0 after registration, one more per publish)."""

    def exclusive_update(self, tenant: str) -> AbstractAsyncContextManager:
        """Held around a tenant's train + publish when the backend cannot interleave other tenants' updates."""

    async def train(self, tenant: str, rollout: Rollout) -> Update:
        """One policy update of the tenant on ``rollout``: its metrics and trained adapter."""

    async def publish(self, tenant: str, update: Update) -> int:
        """Publishes ``update``'s adapter (the tenant's last :meth:`train`) into the sampler in place; returns the
        new version."""

    async def export(self, tenant: str, out_dir: Path) -> None:
        """Writes the tenant's adapter to ``out_dir`` in PEFT format."""

    async def save(self, tenant: str, folder: Path) -> None:
        """Writes everything the tenant's training continues from (adapter, fp32 masters, Adam moments,
        gradients, optimizer step, RNG state) into the existing ``folder``."""

    async def restore(self, tenant: str, folder: Path, version: int) -> None:
        """Replaces the registered tenant's training state with what :meth:`save` wrote into ``folder`` and
        publishes its adapter as ``version``."""

    async def end_training(self, tenant: str) -> None:
        """The tenant trains no more (its steps are done, it stopped or it failed): nothing waits for it."""

    async def remove(self, tenant: str) -> None:
        """Frees everything the tenant holds in the services (after a failure)."""


def eval_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (SkyRL's ``SamplingParams`` fields) in the format SkyRL's evaluation sends them: its
    ``get_sampling_params_for_backend`` for vLLM, the protocol both backends' inference speaks."""
    return get_sampling_params_for_backend("vllm", SamplingParams(**params))


def check_sampled_versions(tenant: str, rollout: Rollout, began_at: int, now: int) -> None:
    """Raises unless every request of every trajectory was sampled with the version the tenant had when its
    sampling began (``began_at``), and the tenant is still at that version (``now``): a publish landing during
    a tenant's rollout would otherwise train the new adapter on the old one's samples."""
    for trajectory, versions in zip(rollout.trajectory_ids, rollout.versions, strict=True):
        if not versions or now != began_at or any(v != began_at for v in versions):
            raise RuntimeError(f"tenant {tenant}: trajectory {trajectory.to_string()} sampled with adapter versions "
                               f"{versions}; its step began at version {began_at} and the tenant is at {now}")


class TenantLoop:
    """One tenant's experiment over ``backend``: evaluation, ``run.steps`` RL steps, evaluation, export; from
    ``resume`` on when given (see the module docstring)."""

    def __init__(self, run: RunConfig, spec: TenantSpec, source: TaskSource, backend: TenantBackend,
                 metrics: MetricsLog, resume: TenantCheckpoint | None = None) -> None:
        self.run, self.spec, self.source, self.backend, self.metrics = run, spec, source, backend, metrics
        self.resume = resume
        self.checkpoints = TenantCheckpoints(checkpoint_root(run), spec.name, run.trainer.max_ckpts_to_keep)
        self.stop_requested = False  # set by TenantPool.stop: stop after the current step
        self.stop_after: int | None = None  # set by TenantPool.stop: stop once this many RL steps are done
        self.step = 0 if resume is None else resume.step  # RL steps done
        self.checkpointed = self.step  # RL steps the newest checkpoint holds (0: none needed yet)
        self.outcome: str | None = None  # once the loop ended: "finished", "stopped" or "failed"

    async def run_experiment(self) -> None:
        """SkyRL's schedule: evaluation before step 1 (``trainer.eval_before_train``), every
        ``trainer.eval_interval`` steps and after the last (none when the interval is <= 0); a checkpoint every
        ``trainer.ckpt_interval`` steps and at the end. Sets :attr:`outcome` when it returns."""
        name, steps, interval = self.spec.name, self.run.steps, self.run.trainer.ckpt_interval
        eval_interval = self.run.trainer.eval_interval
        try:
            if self.resume is None and eval_interval > 0 and self.run.trainer.eval_before_train:
                await self._evaluate(step=0)
            try:
                for step in range(self.step + 1, steps + 1):
                    if STOP.requested() or self.stop_requested or (self.stop_after is not None
                                                                   and step > self.stop_after):
                        await self._stop(done=step - 1)
                        self.outcome = "stopped"
                        return
                    await self._rl_step(step)
                    if eval_interval > 0 and step % eval_interval == 0 and step < steps:
                        await self._evaluate(step)
                    if interval and step % interval == 0 and step < steps:
                        await self._checkpoint(step, finished=False)
            finally:
                await self.backend.end_training(name)
            if eval_interval > 0:
                await self._evaluate(step=steps)
            await self.backend.export(name, self.run.output_dir / "adapters" / name)
            await self._checkpoint(steps, finished=True)
            self.outcome = "finished"
        except Exception as error:  # noqa: BLE001 - a failing tenant must not take the others down
            logger.exception("tenant %s failed", name)
            self.outcome = "failed"
            self.metrics.write({"event": "failed", "tenant": name, "error": f"{type(error).__name__}: {error}"})
            await self.backend.remove(name)

    async def _stop(self, done: int) -> None:
        """Checkpoints the tenant after ``done`` RL steps (unless its last checkpoint holds them), exports its
        adapter and records that it stopped."""
        name = self.spec.name
        if done > self.checkpointed:
            await self._checkpoint(done, finished=False)
        await self.backend.export(name, self.run.output_dir / "adapters" / name)
        self.metrics.write({"event": "stopped", "tenant": name, "step": done})

    async def _checkpoint(self, step: int, finished: bool) -> None:
        name = self.spec.name
        records = [record for record in self.metrics.records if record.get("tenant") == name]
        await self.checkpoints.write(step, self.backend.version(name), finished, records, self.run.identity,
                                     lambda folder: self.backend.save(name, folder))
        self.checkpointed = step

    async def _sample(self, rows: list[dict[str, Any]], samples: int, tag: str,
                      sampling_params: dict[str, Any] | None = None) -> Rollout:
        began_at = self.backend.version(self.spec.name)
        rollout = await self.backend.sample(self.spec, rows, samples, tag, sampling_params)
        check_sampled_versions(self.spec.name, rollout, began_at, self.backend.version(self.spec.name))
        return rollout

    async def _evaluate(self, step: int) -> None:
        """SkyRL's evaluation (``skyrl.train.evaluate``): every evaluation row, ``generator.eval_n_samples_per_prompt``
        episodes each, sampled with ``generator.eval_sampling_params``; the record holds SkyRL's metrics
        (``eval/all/avg_score``, ``eval/all/pass_at_<n>``, per data source, ...) beside the accuracy."""
        rows = self.source.evaluation_rows()
        if rows:
            evaluation = self.run.evaluation
            rollout = await self._sample(rows, evaluation.samples_per_prompt, f"eval{step}",
                                         eval_sampling_params(evaluation.sampling_params))
            self.metrics.write(eval_record(self.spec.name, step, rollout.output, rollout.groups, rows,
                                           evaluation.samples_per_prompt))

    async def _rl_step(self, step: int) -> None:
        name = self.spec.name
        started = time.perf_counter()
        rows = self.source.step_rows(step - 1, self.run.recipe.prompts_per_step)
        rollout = await self._sample(rows, self.spec.samples_per_prompt, f"s{step}")
        rollout_s = time.perf_counter() - started
        async with self.backend.exclusive_update(name):
            started = time.perf_counter()
            update = await self.backend.train(name, rollout)
            train_s = time.perf_counter() - started
            started = time.perf_counter()
            version = await self.backend.publish(name, update)
            sync_s = time.perf_counter() - started
        timings = {"rollout_s": rollout_s, "train_s": train_s, "sync_s": sync_s}
        self.metrics.write(step_record(name, step, version, rollout.output, timings, update.metrics))
        self.step = step


class TenantPool:
    """The tenants of one set of services: started together, joined and stopped while the others run.

    ``add`` validates a new tenant as a start-time one is (a bad spec is a :class:`ConfigError` for the caller;
    the run goes on), registers it (restored from a checkpoint when given one) and starts its loop; ``stop``
    makes a tenant stop after its current step, or after a given step (checkpointed and exported). ``join``
    returns once every tenant's loop has ended, added ones included. ``refuse_adds`` is why this pool takes no
    new tenant (None: it takes them while fewer than ``run.tenant_capacity`` tenants hold adapter slots; a
    tenant keeps its slot until the run ends, or until :meth:`release` frees it).
    """

    def __init__(self, run: RunConfig, backend: TenantBackend, metrics: MetricsLog,
                 resume: dict[str, TenantCheckpoint], refuse_adds: str | None) -> None:
        self.run, self.backend, self.metrics, self.resume = run, backend, metrics, resume
        self.refuse_adds = refuse_adds
        self.loops: dict[str, TenantLoop] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self._lock = asyncio.Lock()

    async def start(self, specs: list[TenantSpec], sources: dict[str, TaskSource]) -> None:
        """Registers every unfinished tenant of ``specs`` (in order; restored from its checkpoint in ``resume``
        when it has one), then starts their loops."""
        asyncio.get_running_loop().set_exception_handler(log_orphaned_task_error)
        loops = [TenantLoop(self.run, spec, sources[spec.name], self.backend, self.metrics, self.resume.get(spec.name))
                 for spec in specs if not (spec.name in self.resume and self.resume[spec.name].finished)]
        for loop in loops:
            await self._register(loop)
        for loop in loops:
            self.tasks[loop.spec.name] = asyncio.create_task(loop.run_experiment())

    async def add(self, spec: TenantSpec, source: TaskSource, resume: TenantCheckpoint | None = None) -> asyncio.Task:
        """Starts tenant ``spec`` (validated by the caller) beside the running ones; from its checkpoint ``resume``
        when given (its records so far go into the metrics log first, as a resumed run's do). Returns its loop's
        task."""
        async with self._lock:
            if spec.name in self.loops:
                raise ConfigError(f"tenant {spec.name} already holds a slot here; choose another name")
            if self.refuse_adds is not None:
                raise ConfigError(self.refuse_adds)
            if len(self.loops) >= self.run.tenant_capacity:
                raise ConfigError(f"{len(self.loops)} tenants hold adapter slots, the most this run has "
                                  f"(clora.max_tenants={self.run.max_tenants}; a tenant keeps its slot until the run "
                                  "ends); start the run with a larger clora.max_tenants")
            loop = TenantLoop(self.run, spec, source, self.backend, self.metrics, resume)
            await self._register(loop)
            if resume is not None:
                self.metrics.extend_resumed(resume.records)
            self.tasks[spec.name] = asyncio.create_task(loop.run_experiment())
            return self.tasks[spec.name]

    def stop(self, name: str, after_step: int | None = None) -> None:
        """Asks running tenant ``name`` to stop after its current step, or (``after_step``) once it has done that
        many RL steps (after its current step when it has done them already)."""
        if name not in self.tasks or self.tasks[name].done():
            raise ConfigError(f"tenant {name} is not running here; running: {', '.join(self.running()) or 'none'}")
        if after_step is None:
            self.loops[name].stop_requested = True
        else:
            self.loops[name].stop_after = after_step

    async def release(self, name: str) -> None:
        """Frees the slot and services state of tenant ``name``, whose loop has ended (a failed tenant's state is
        freed already); the pool forgets it, so it may be added again."""
        async with self._lock:
            if name not in self.tasks or not self.tasks[name].done():
                raise RuntimeError(f"tenant {name} is running here or unknown; only an ended tenant is released")
            loop = self.loops.pop(name)
            del self.tasks[name]
            if loop.outcome != "failed":
                await self.backend.remove(name)

    def running(self) -> list[str]:
        return [name for name, task in self.tasks.items() if not task.done()]

    async def steps_done(self) -> dict[str, int]:
        """The RL steps done by each running tenant."""
        return {name: self.loops[name].step for name in self.running()}

    async def join(self) -> None:
        while self.running():  # a tenant added while the others ran is awaited too
            await asyncio.gather(*self.tasks.values())

    async def _register(self, loop: TenantLoop) -> None:
        await self.backend.register(loop.spec)
        if loop.resume is not None:
            await self.backend.restore(loop.spec.name, loop.resume.folder, loop.resume.version)
        self.loops[loop.spec.name] = loop


class PoolHost(Protocol):
    """Keeps a :class:`TenantPool` open past its start-time tenants (a replica that tenants move in and out of)."""

    async def serve(self, pool: TenantPool) -> None:
        """Runs on the pool's event loop once its start-time tenants' loops began; returns when the host is
        closed and every tenant's loop has ended."""


async def run_tenant_pool(run: RunConfig, backend: TenantBackend, specs: list[TenantSpec],
                          sources: dict[str, TaskSource], metrics: MetricsLog, resume: dict[str, TenantCheckpoint],
                          stopped: list[str], refuse_adds: str | None, host: PoolHost | None = None) -> None:
    """Runs ``specs`` over ``backend`` as a :class:`TenantPool` (those in ``stopped`` stay stopped), with the
    control endpoint while they run (``run.control``); returns when every tenant's loop has ended, or with
    ``host`` when ``host.serve`` returns (it keeps the pool open for tenants it adds)."""
    pool = TenantPool(run, backend, metrics, resume, refuse_adds)
    server = ControlServer(run, pool, [spec.name for spec in run.tenants]) if run.control else None
    await pool.start([spec for spec in specs if spec.name not in stopped], sources)
    for name in [spec.name for spec in specs if spec.name in stopped]:
        metrics.write({"event": "stopped", "tenant": name, "step": resume[name].step if name in resume else 0})
    if server is not None:
        await server.start()
    try:
        await (host.serve(pool) if host is not None else pool.join())
    finally:
        if server is not None:
            await server.close()


def episode_batch(seed: int, rows: list[dict[str, Any]], samples: int, tag: str,
                  env_args: dict[str, Any] | None = None,
                  sampling_params: dict[str, Any] | None = None) -> tuple[GeneratorInput, list[TrajectoryID], list[str]]:
    """``samples`` episodes of each dataset row (``prompt``, ``env_class`` and the environment's extras), as
    SkyRL's ``GeneratorInput``; returns it with the trajectory ids and the GRPO group id of each episode
    (``s<seed>-<tag>-p<row>``: named after the tenant's seed, not its name, since the sampler derives each
    request's RNG seed from it). ``env_args`` are added to every episode's extras. ``sampling_params`` (the
    inference backend's format) go with every request; None leaves them to the inference client's defaults
    (the embedded client applies the run's)."""
    prompts, env_classes, extras, trajectory_ids, groups = [], [], [], [], []
    for index, row in enumerate(rows):
        instance = f"s{seed}-{tag}-p{index}"
        for repetition in range(samples):
            prompts.append(row["prompt"])
            env_classes.append(row["env_class"])
            extras.append({**{k: v for k, v in row.items() if k not in ("prompt", "env_class")}, **(env_args or {})})
            trajectory_ids.append(TrajectoryID(instance_id=instance, repetition_id=repetition))
            groups.append(instance)
    batch = GeneratorInput(prompts=prompts, env_classes=env_classes, env_extras=extras, sampling_params=sampling_params,
                           trajectory_ids=trajectory_ids, batch_metadata=None)
    return batch, trajectory_ids, groups


def scalar_reward(reward: float | list[float]) -> float:
    """An episode's outcome reward (SkyRL gives per-token reward lists for multi-turn episodes)."""
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def eval_record(tenant: str, step: int, output: dict[str, Any], groups: list[str], rows: list[dict[str, Any]],
                samples: int) -> dict[str, Any]:
    """The metrics record of an evaluation of ``rows``, ``samples`` episodes each (``groups``: each episode's row id):
    accuracy = share of episodes with reward >= 1, and SkyRL's evaluation metrics as ``skyrl.train.evaluate`` names
    them: ``avg_score``, ``pass_at_<samples>`` and ``mean_positive_reward`` (SkyRL's
    ``get_metrics_from_generator_output``) over all rows (``eval/all/``) and per data source (a row's ``data_source``:
    ``eval/<data_source>/``, ``/`` written ``_``, none ``unknown``, as SkyRL's ``calculate_per_dataset_metrics``, whose
    module needs torchdata, which the plugin does not), and the rollout metrics under ``eval/all/``."""
    rewards = [scalar_reward(r) for r in output["rewards"]]
    sources = [str(row.get("data_source") or "unknown").replace("/", "_") for row in rows for _ in range(samples)]
    metrics: dict[str, float] = {}
    for source, indices in _indices_by(sources).items():
        scored = {key: [value[i] for i in indices] for key, value in output.items() if isinstance(value, list)}
        scored_groups = [groups[i] for i in indices]
        metrics |= _skyrl_eval_metrics(f"eval/{source}", get_metrics_from_generator_output(scored, scored_groups), samples)
    metrics |= _skyrl_eval_metrics("eval/all", get_metrics_from_generator_output(output, groups), samples)
    rollout = output.get("rollout_metrics") or {}
    metrics |= {f"eval/all/{k}": v for k, v in rollout.items() if isinstance(v, (int, float))}
    return {"event": "eval", "tenant": tenant, "step": step,
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards), "episodes": len(rewards), **metrics}


def _indices_by(keys: list[str]) -> dict[str, list[int]]:
    indices: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        indices.setdefault(key, []).append(index)
    return indices


def _skyrl_eval_metrics(prefix: str, metrics: Any, samples: int) -> dict[str, float]:
    return {f"{prefix}/avg_score": metrics["avg_score"], f"{prefix}/pass_at_{samples}": metrics["pass_at_n"],
            f"{prefix}/mean_positive_reward": metrics["mean_positive_reward"]}


def step_record(tenant: str, step: int, version: int, output: dict[str, Any], timings: dict[str, float],
                train_metrics: dict[str, float]) -> dict[str, Any]:
    """The metrics record of an RL step: rewards, tokens, ``timings`` (rollout_s, train_s, sync_s), the
    trainer's metrics as ``train/*`` and SkyRL's rollout metrics (e.g. the env's reward breakdown) as ``rollout/*``."""
    rewards = [scalar_reward(r) for r in output["rewards"]]
    return {
        "event": "step", "tenant": tenant, "step": step, "adapter_version": version,
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "episodes": len(rewards),
        "generated_tokens": sum(sum(mask) for mask in output["loss_masks"]),
        **timings,
        **{f"train/{k}": v for k, v in train_metrics.items()},
        **{f"rollout/{k}": v for k, v in (output.get("rollout_metrics") or {}).items() if isinstance(v, (int, float))},
    }


def log_orphaned_task_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """SkyRL's generator gathers a batch's episodes without cancelling the rest when one raises; the
    other episodes of a failed tenant (already recorded as failed) then end with errors nobody awaits."""
    error = context.get("exception")
    logger.debug("an episode task ended with an unobserved error (its tenant is failed): %r", error)
