"""``backend=skyrl``: N tenants driven through SkyRL's own stack.

Per tenant: a ``SkyRLGymGenerator`` (``policy_model_name=<tenant>``, the tenant's translated generator
config) over its :class:`~skyrl_clora.skyrl.tenant_client.TenantInferenceClient` view of the shared
``RemoteInferenceClient``, and a ``WorkerDispatch`` (the tenant's translated config, the view as its
inference client) over one shared ``PPORayActorGroup`` of policy workers. A tenant's RL step is SkyRL's:

  1. generate: the generator runs the step's episodes through the view (``model=<tenant>``);
  2. version check: every request of every trajectory was sampled with the tenant's current adapter
     version (the embedded server reports it per request), else the step fails; vLLM reports none, and
     there the order of a tenant's own phases is the guarantee (its sync lands between its generations);
  3. train: the episodes become SkyRL's ``TrainingInputBatch`` (:func:`training_input`) and go through
     ``dispatch.forward_backward`` and ``dispatch.optim_step`` with ``model_id=<tenant>`` (the embedded
     worker swaps the tenant's adapter, LR schedule and RNG in; for Megatron the tenant's scheduled LR is
     sent first with ``dispatch.set_lr(model_id=<tenant>)``, as SkyRL's Tinker backend does);
  4. sync: ``dispatch.save_weights_for_sampler(model_id=<tenant>)``: the worker writes the adapter as a
     PEFT folder and loads it in place under the tenant's name (no pause, no prefix-cache reset), and
     the dispatch advances the view's version, which must equal the version the server now holds.

Tenants register through ``dispatch.register_adapter`` and their first ``save_weights_for_sampler``
(version 0) and, on failure, are deleted (``dispatch.delete_adapter``) and unloaded. The trainer is one
worker, so train+sync sections of different tenants take turns (a lock); generation is concurrent.
On this machine the stack is the embedded engine behind :class:`~skyrl_clora.skyrl.server.EmbeddedServer`
(vLLM's stand-in) and :class:`~skyrl_clora.skyrl.worker.EmbeddedPolicyWorker` Ray actors (Megatron's).
Outputs are the embedded backend's: metrics.jsonl, summary.json, reward_curves.png, adapters/<tenant>/.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_advantages_and_returns
from skyrl.train.config import AlgorithmConfig
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

from skyrl_clora.config import ConfigError, RunConfig
from skyrl_clora.metrics import MetricsLog, write_run_summary
from skyrl_clora.episodes import episode_batch, eval_record, log_orphaned_task_error, step_record
from skyrl_clora.recipes.tasks import TaskSource
from skyrl_clora.skyrl.config_translation import SkyRLPlan
from skyrl_clora.skyrl.stack import SkyRLStack, build_stack
from skyrl_clora.tenants import TenantSpec
from skyrl_clora.trainer.adapter_store import LRSchedule

logger = logging.getLogger("skyrl_clora")


@dataclass
class Tenant:
    """One tenant's handles on the shared stack."""

    spec: TenantSpec
    dispatch: WorkerDispatch
    generator: SkyRLGymGenerator
    view: Any


class SkyRLTenantLoop:
    """One tenant's experiment on SkyRL's stack: evaluation, ``steps`` RL steps, evaluation, export."""

    def __init__(self, run: RunConfig, tenant: Tenant, source: TaskSource, stack: SkyRLStack, metrics: MetricsLog,
                 train_lock: asyncio.Lock) -> None:
        self.run, self.tenant, self.stack, self.metrics, self.train_lock = run, tenant, stack, metrics, train_lock
        self.source = source
        self.name = tenant.spec.name
        self.schedule = LRSchedule(tenant.spec.lr, run.trainer.warmup_steps, run.steps, run.trainer.lr_schedule)
        self.algorithm = tenant.dispatch.cfg.trainer.algorithm
        self.steps_done = 0

    async def register(self) -> None:
        """``register_adapter`` on the workers, then the first sync publishes version 0."""
        async with self.train_lock:
            await asyncio.to_thread(self.tenant.dispatch.register_adapter, "policy", self.name)
            await asyncio.to_thread(self._sync)

    def _sync(self) -> None:
        """``save_weights_for_sampler`` (runs in a worker thread: the dispatch blocks on Ray) plus the
        version check between what the dispatch counted and what the servers hold."""
        asyncio.run(self.tenant.dispatch.save_weights_for_sampler(model_id=self.name))
        held = self.stack.server_version(self.name)
        if held is not None and held != self.tenant.view.weight_version:
            raise RuntimeError(f"tenant {self.name}: the servers hold adapter version {held} but the dispatch "
                               f"counted {self.tenant.view.weight_version}")

    async def run_experiment(self) -> None:
        try:
            await self._evaluate(step=0)
            for step in range(1, self.run.steps + 1):
                await self._rl_step(step)
            await self._evaluate(step=self.run.steps)
            exported = Path(self.stack.sync_path) / self.name  # the last sync wrote the final adapter there
            shutil.copytree(exported, self.run.output_dir / "adapters" / self.name, dirs_exist_ok=True)
        except Exception as error:  # noqa: BLE001 - a failing tenant must not take the others down
            logger.exception("tenant %s failed", self.name)
            self.metrics.write({"event": "failed", "tenant": self.name, "error": f"{type(error).__name__}: {error}"})
            async with self.train_lock:
                await asyncio.to_thread(self.tenant.dispatch.delete_adapter, "policy", self.name)
            await self.stack.unload(self.name)

    async def _generate(self, rows: list[dict[str, Any]], samples: int, tag: str) -> tuple[dict, list[str]]:
        """Runs ``samples`` episodes per row through SkyRL's generator with the run's sampling params (as
        SkyRL's trainer sends them: a vLLM server would otherwise apply vLLM's own defaults, e.g. 16 tokens);
        returns its output and group ids."""
        generator_cfg = self.tenant.dispatch.cfg.generator
        sampling = get_sampling_params_for_backend(generator_cfg.inference_engine.backend, generator_cfg.sampling_params)
        batch, trajectory_ids, groups = episode_batch(self.name, rows, samples, tag, sampling_params=sampling)
        version = self.tenant.view.weight_version
        output = await self.tenant.generator.generate(batch, disable_tqdm=True)
        for trajectory in trajectory_ids if self.stack.reports_versions else ():
            versions = self.tenant.view.versions_for(trajectory.to_string())
            if not versions or any(v != version for v in versions):
                raise RuntimeError(f"tenant {self.name}: trajectory {trajectory.to_string()} sampled with adapter "
                                   f"versions {versions}, expected {version}")
        return output, groups

    async def _evaluate(self, step: int) -> None:
        rows = self.source.evaluation_rows()
        if not rows:
            return
        output, _ = await self._generate(rows, samples=1, tag=f"eval{step}")
        self.metrics.write(eval_record(self.name, step, output))

    async def _rl_step(self, step: int) -> None:
        started = time.perf_counter()
        output, groups = await self._generate(
            self.source.step_rows(step - 1, self.run.recipe.prompts_per_step), self.tenant.spec.samples_per_prompt, f"s{step}"
        )
        rollout_s = time.perf_counter() - started
        data = training_input(output, groups, self.stack.tokenizer.pad_token_id, self.algorithm)
        async with self.train_lock:
            started = time.perf_counter()
            train_metrics = await asyncio.to_thread(self._train, data)
            train_s = time.perf_counter() - started
            started = time.perf_counter()
            await asyncio.to_thread(self._sync)
            sync_s = time.perf_counter() - started
        timings = {"rollout_s": rollout_s, "train_s": train_s, "sync_s": sync_s}
        self.metrics.write(step_record(self.name, step, self.tenant.view.weight_version, output, timings, train_metrics))

    def _train(self, data: TrainingInputBatch) -> dict[str, float]:
        """``forward_backward`` + ``optim_step`` with the tenant's ``model_id``; the step's metrics."""
        dispatch = self.tenant.dispatch
        lr = self.schedule.lr(self.steps_done)
        if self.stack.strategy == "megatron":
            dispatch.set_lr("policy", lr, model_id=self.name)
        output = dispatch.forward_backward("policy", data, model_id=self.name)
        grad_norm = dispatch.optim_step("policy", model_id=self.name)
        self.steps_done += 1
        metrics = self.stack.step_metrics(self.name, output.metrics, grad_norm, lr)
        if metrics.get("grad_norm") != grad_norm or metrics.get("lr") != lr:
            raise RuntimeError(f"tenant {self.name}: the worker's last step ({metrics.get('lr')=}, "
                               f"{metrics.get('grad_norm')=}) is not this one ({lr=}, {grad_norm=})")
        return metrics


def training_input(output: dict[str, Any], groups: list[str], pad_token_id: int,
                   algorithm: AlgorithmConfig) -> TrainingInputBatch:
    """SkyRL's ``TrainingInputBatch`` for a generator output, as ``RayPPOTrainer.convert_to_training_input``
    builds it (outcome reward on the last response token; ``metadata["uids"]`` = GRPO groups), plus what
    SkyRL's policy workers read for the update: ``advantages`` from SkyRL's estimator (``algorithm``) and
    ``action_log_probs`` = the rollout log-probs (one on-policy update per step, as SkyRL's Tinker backend
    sends them). The embedded worker recomputes advantages itself from ``rewards`` and ``uids``."""
    rewards = [r if isinstance(r, list) else [0.0] * (len(ids) - 1) + [float(r)]
               for r, ids in zip(output["rewards"], output["response_ids"])]
    sequences, attention, response_mask, token_rewards, loss_mask, logprobs, _, _ = convert_prompts_responses_to_batch_tensors(
        pad_token_id, output["prompt_token_ids"], output["response_ids"], rewards, output["loss_masks"],
        output.get("rollout_logprobs"),
    )
    advantages, returns = compute_advantages_and_returns(
        token_level_rewards=token_rewards, response_mask=response_mask, index=list(groups),
        adv_estimator=algorithm.advantage_estimator, config=algorithm, values=None, gamma=algorithm.gamma,
        lambd=algorithm.lambd, grpo_norm_by_std=algorithm.grpo_norm_by_std,
    )
    data = TrainingInputBatch({
        "sequences": sequences, "attention_mask": attention, "response_mask": response_mask,
        "rewards": token_rewards, "loss_mask": loss_mask, "rollout_logprobs": logprobs,
        "action_log_probs": logprobs, "advantages": advantages, "returns": returns,
    })
    data.metadata = {"uids": list(groups), "response_length": response_mask.shape[1]}
    return data


async def _run_tenants(run: RunConfig, plan: SkyRLPlan, sources: dict[str, TaskSource], stack: SkyRLStack,
                       metrics: MetricsLog) -> None:
    asyncio.get_running_loop().set_exception_handler(log_orphaned_task_error)
    lock = asyncio.Lock()
    loops = []
    for spec in plan.tenants:
        config = plan.tenant_configs[spec.name]
        view = stack.views[spec.name]
        dispatch = WorkerDispatch(config, policy_actor_group=stack.policy_group, inference_engine_client=view)
        generator = SkyRLGymGenerator(config.generator, config.environment.skyrl_gym, view, stack.tokenizer,
                                      policy_model_name=spec.name)
        loops.append(SkyRLTenantLoop(run, Tenant(spec, dispatch, generator, view), sources[spec.name], stack, metrics, lock))
    # One weight-sync setup for the worker group (it keeps the shared client's server URLs).
    await asyncio.to_thread(loops[0].tenant.dispatch.init_weight_sync_state, stack.client)
    for loop in loops:
        await loop.register()
    try:
        await asyncio.gather(*(loop.run_experiment() for loop in loops))
    finally:
        for client in [stack.client, *stack.views.values()]:
            await client.teardown()


def run_skyrl(run: RunConfig, plan: SkyRLPlan, sources: dict[str, TaskSource], model_path: str,
              base_model_s: float) -> dict[str, Any]:
    """Runs every tenant concurrently through SkyRL's stack on its task data ``sources`` (by tenant name,
    ``recipes.tasks.build_task_sources``); writes the embedded backend's outputs."""
    if run.mode != "concurrent":
        raise ConfigError("backend=skyrl runs tenants concurrently on one stack; set clora.mode=concurrent "
                          "(serial mode is the embedded backend's baseline)")
    for line in plan.substitutions:
        print(f"[skyrl] stand-in: {line}", flush=True)
    started = time.perf_counter()
    metrics = MetricsLog(run.output_dir / "metrics.jsonl", progress=run.progress)
    stack = build_stack(run, plan, model_path)
    try:
        cold_start_s = time.perf_counter() - started
        asyncio.run(_run_tenants(run, plan, sources, stack, metrics))
    finally:
        metrics.close()
        stack.shutdown()
    wall_s = time.perf_counter() - started
    fields = {
        "backend": "skyrl", "mode": run.mode, "steps": run.steps, "model_path": model_path,
        "inference_backend": plan.inference_backend, "strategy": plan.strategy, "substitutions": list(plan.substitutions),
        "cold_start_seconds": [cold_start_s], "engine": stack.engine_stats(),
    }
    return write_run_summary(run.output_dir, metrics.records, list(plan.tenants), fields, wall_s, base_model_s,
                             "backend=skyrl")
