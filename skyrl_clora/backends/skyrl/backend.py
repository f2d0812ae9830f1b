"""``backend=skyrl``: N tenants driven through SkyRL's own stack, by the tenant loop (``tenant_loop``) over
:class:`SkyRLBackend`.

Per tenant: a ``SkyRLGymGenerator`` (``policy_model_name=<tenant>``, the tenant's translated generator
config) over its :class:`~skyrl_clora.backends.skyrl.tenant_client.TenantInferenceClient` view of the shared
``RemoteInferenceClient``, and a ``WorkerDispatch`` (the tenant's translated config, the view as its
inference client) over one shared ``PPORayActorGroup`` of policy workers. A tenant's RL step is SkyRL's:

  1. generate: the generator runs the step's episodes through the view (``model=<tenant>``);
  2. version check (the tenant loop's): every request of every trajectory was sampled with the tenant's
     current adapter version, else the step fails: the version the embedded server reports per request, or,
     from vLLM, which reports none, the view's own version around the request (see ``tenant_client``);
  3. train: the episodes become SkyRL's ``TrainingInputBatch`` (:func:`training_input`); as SkyRL's trainer
     does, ``dispatch.forward`` (per mini-batch with ``recompute_old_logprobs_per_minibatch``: :func:`behaviour_logprobs`)
     recomputes the behaviour policy's ``action_log_probs`` with the tenant's adapter
     (``clora.step_style=tinker``: the sampler's log-probs instead, as SkyRL's Tinker backend sends them) and,
     with ``use_kl_loss`` or ``use_kl_in_reward``, the reference's ``base_action_log_probs`` under
     ``REFERENCE_MODEL_ID`` (the frozen base, at temperature 1 as SkyRL's reference worker: :func:`reference_logprobs`;
     with ``use_kl_in_reward`` the rewards then lose SkyRL's KL penalty
     and the advantages are computed again, as ``RayPPOTrainer.apply_reward_kl_penalty`` does); then, as
     ``RayPPOTrainer._execute_training_step``: the advantages scaled per policy mini-batch by SkyRL's loss reduction
     (``_normalize_advantages``), and for each of ``update_epochs_per_batch`` epochs, per mini-batch of
     ``policy_mini_batch_size`` prompts (in batch order), ``dispatch.forward_backward`` and ``dispatch.optim_step``
     with ``model_id=<tenant>`` (the embedded worker, and SkyRL's FSDP2 worker with its tenant store, swap the
     tenant's adapter, optimizer state, LR schedule and RNG in; for Megatron the tenant's scheduled LR is sent first
     with ``dispatch.set_lr(model_id=<tenant>)``, as SkyRL's Tinker backend does). The tenant's LR schedule counts
     optimizer steps. The step fails unless the LR the worker reports for each optimizer step is the tenant's
     scheduled one, to float32 rounding (and, on the embedded worker, its recorded gradient norm is the one
     ``optim_step`` returned); its metrics are SkyRL's mean over the optimizer steps;
  4. sync: ``dispatch.save_weights_for_sampler(model_id=<tenant>)``: the worker writes the adapter as a
     PEFT folder and loads it in place under the tenant's name (no pause, no prefix-cache reset), and
     the dispatch advances the view's version, which must equal the version the server now holds.

A step's update reports, beside SkyRL's metrics, the wall seconds of its parts (:data:`STEP_PHASES`; in the step
record as ``train/<phase>``, beside the tenant loop's ``rollout_s``, ``train_s`` and ``sync_s``, which is step 4).

Tenants register through ``dispatch.register_adapter`` and their first ``save_weights_for_sampler``
(version 0) and, on failure, are deleted (``dispatch.delete_adapter``) and unloaded. The trainer is one
worker, so train+sync sections of different tenants take turns (a lock); generation is concurrent.
On this machine the stack is the embedded engine behind :class:`~skyrl_clora.backends.skyrl.server.EmbeddedServer`
(vLLM's stand-in) and :class:`~skyrl_clora.skyrl.worker.EmbeddedPolicyWorker` Ray actors (Megatron's).
Outputs are the embedded backend's: metrics.jsonl, summary.json, reward_curves.png, adapters/<tenant>/.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from skyrl.backends.skyrl_train.distributed.dispatch import loss_fn_outputs_to_tensor
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_advantages_and_returns
from skyrl.backends.skyrl_train.workers.worker_utils import reduce_metrics
from skyrl.train.config import AlgorithmConfig
from skyrl.train.dataset.preprocess import compute_prompt_mini_batch_boundaries, convert_prompts_responses_to_batch_tensors
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

from skyrl_clora.base_model import resolve_model_path
from skyrl_clora.checkpoints import TenantCheckpoint, resumed_records
from skyrl_clora.config.schema import RunConfig
from skyrl_clora.metrics import MetricsLog, PoolOutcome
from skyrl_clora.recipes.plugin import TaskSource
from skyrl_clora.backends.skyrl.config_translation import SkyRLPlan
from skyrl_clora.backends.skyrl.stack import SkyRLStack, build_stack
from skyrl_clora.skyrl.worker import REFERENCE_MODEL_ID
from skyrl_clora.skyrl.worker_patches import with_salt_gated_lora_sync
from skyrl_clora.tenant_loop import Rollout, Update, episode_batch, run_tenant_pool
from skyrl_clora.tenants import TenantSpec
from skyrl_clora.trainer.kl import kl_reward_penalty
from skyrl_clora.trainer.loss_reduction import reduce_advantages
from skyrl_clora.trainer.lr_schedule import LRSchedule

# Each tenant's dispatch tells the worker when its sync may skip the global prefix-cache reset (patch 0001).
SALT_GATED_DISPATCH = with_salt_gated_lora_sync(WorkerDispatch)

STEP_PHASES = ("lock_wait_s", "swap_s", "recompute_s", "reference_s", "forward_backward_s", "optim_s")
"""The wall seconds a tenant's update reports (:meth:`SkyRLBackend.train`), each around the driver's blocking calls:

- ``lock_wait_s``: waiting for the worker group (the update lock other tenants' train + sync hold), before ``train_s``;
- ``swap_s``: ``dispatch.ensure_active_adapter``: the tenant's adapter, optimizer state, LR schedule and RNG swapped
  in on the workers, one Ray round trip (the dispatch's later swaps of the step find it live);
- ``recompute_s``: the behaviour log-probs, ``dispatch.forward`` (or ``stage_data`` + ``forward_from_staged`` per
  mini-batch), and with ``use_kl_in_reward`` and ``clora.step_style=tinker`` the policy forward for the KL penalty;
- ``reference_s``: the KL reference's log-probs (``use_kl_loss`` / ``use_kl_in_reward``; else 0);
- ``forward_backward_s``, ``optim_s``: every ``dispatch.forward_backward`` and ``dispatch.optim_step`` of the step,
  summed (Megatron's ``dispatch.set_lr`` counts in ``optim_s``).

All but ``lock_wait_s`` lie inside the tenant loop's ``train_s``; the rest of ``train_s`` is the driver's own work
(SkyRL's batch tensors, advantages, mini-batch slices, the report checks) and its thread hop."""


@dataclass
class Tenant:
    """One tenant's handles on the shared stack, and its LR schedule and step count (the driver sends
    Megatron the scheduled LR, and reads the worker's step metrics, per step)."""

    spec: TenantSpec
    dispatch: WorkerDispatch
    generator: SkyRLGymGenerator
    view: Any
    schedule: LRSchedule
    steps_done: int = 0


class SkyRLBackend:
    """:class:`~skyrl_clora.tenant_loop.TenantBackend` over SkyRL's stack (see module docstring)."""

    def __init__(self, run: RunConfig, plan: SkyRLPlan, stack: SkyRLStack) -> None:
        self.run, self.plan, self.stack = run, plan, stack
        self.tenants: dict[str, Tenant] = {}
        self._update_lock = asyncio.Lock()
        self._lock_waits: dict[str, float] = {}  # by tenant: its wait for the update lock, until its train reports it
        self.register_seconds: dict[str, float] = {}  # by tenant: its register (adapter slot + first sync)

    async def register(self, spec: TenantSpec) -> None:
        """``register_adapter`` on the workers, then the first sync publishes version 0; its wall seconds go to
        :attr:`register_seconds`."""
        started = time.perf_counter()
        config, view = self.plan.tenant_configs[spec.name], self.stack.views[spec.name]
        dispatch = SALT_GATED_DISPATCH(config, policy_actor_group=self.stack.policy_group, inference_engine_client=view)
        first = not self.tenants
        if first:  # one weight-sync setup for the worker group (it keeps the shared client's server URLs)
            await asyncio.to_thread(dispatch.init_weight_sync_state, self.stack.client)
        generator = SkyRLGymGenerator(config.generator, config.environment.skyrl_gym, view, self.stack.tokenizer,
                                      policy_model_name=spec.name)
        # SkyRL's scheduler counts optimizer steps: RL steps * mini-batches per step * update epochs
        schedule = LRSchedule(spec.lr, self.run.trainer.num_warmup_steps,
                              self.run.steps * self.run.optimizer_steps_per_rl_step, self.run.trainer.scheduler)
        self.tenants[spec.name] = Tenant(spec, dispatch, generator, view, schedule)
        async with self._update_lock:
            algorithm = config.trainer.algorithm
            if first and (algorithm.use_kl_loss or algorithm.use_kl_in_reward):  # the KL reference, shared: the base
                await asyncio.to_thread(dispatch.register_adapter, "policy", REFERENCE_MODEL_ID)
            await asyncio.to_thread(dispatch.register_adapter, "policy", spec.name)
            await self._sync(spec.name)
        self.register_seconds[spec.name] = time.perf_counter() - started

    async def sample(self, spec: TenantSpec, rows: list[dict[str, Any]], samples: int, tag: str,
                     sampling_params: dict[str, Any] | None = None) -> Rollout:
        """The episodes with ``sampling_params`` (evaluation's) or else the run's training ones, as SkyRL's trainer
        sends them (a vLLM server would otherwise apply vLLM's own defaults, e.g. 16 tokens)."""
        tenant = self.tenants[spec.name]
        generator_cfg = tenant.dispatch.cfg.generator
        sampling = sampling_params or get_sampling_params_for_backend(generator_cfg.inference_engine.backend,
                                                                      generator_cfg.sampling_params)
        batch, trajectory_ids, groups = episode_batch(spec.seed, rows, samples, tag, sampling_params=sampling)
        if generator_cfg.batched:  # SkyRL's batched generate sends no session ids: the trajectories' go with it
            tenant.view.expect_batch([t.to_string() for t in trajectory_ids])
        output = await tenant.generator.generate(batch, disable_tqdm=True)
        versions = [tenant.view.versions_for(t.to_string()) for t in trajectory_ids]
        return Rollout(output, groups, trajectory_ids, versions)

    def version(self, tenant: str) -> int:
        return self.tenants[tenant].view.weight_version

    @asynccontextmanager
    async def exclusive_update(self, tenant: str) -> AsyncIterator[None]:
        """The worker group trains one tenant at a time: a tenant's train + sync hold the update lock; the seconds
        it waited for it are its next :meth:`train`'s ``lock_wait_s``."""
        asked = time.perf_counter()
        async with self._update_lock:
            self._lock_waits[tenant] = time.perf_counter() - asked
            yield

    async def train(self, tenant: str, rollout: Rollout) -> Update:
        """The step's update on the workers, which keep the trained adapter (the update carries no weights); its
        metrics hold the :data:`STEP_PHASES`. Runs inside :meth:`exclusive_update`."""
        waited = self._lock_waits.pop(tenant)
        data = training_input(rollout.output, rollout.groups, self.stack.tokenizer.pad_token_id,
                              self.tenants[tenant].dispatch.cfg.trainer.algorithm)
        metrics = await asyncio.to_thread(self._train, self.tenants[tenant], data)
        return Update({**metrics, "lock_wait_s": waited})

    def _train(self, tenant: Tenant, data: TrainingInputBatch) -> dict[str, float]:
        """The behaviour (and, with KL, reference) log-probs into ``data``, then ``forward_backward`` +
        ``optim_step`` with the tenant's ``model_id``; the step's metrics, checked against the worker's reports,
        with the seconds of its :data:`STEP_PHASES` but ``lock_wait_s``."""
        name, dispatch = tenant.spec.name, tenant.dispatch
        algorithm = dispatch.cfg.trainer.algorithm
        seconds = dict.fromkeys(STEP_PHASES[1:], 0.0)
        with _timed(seconds, "swap_s"):
            dispatch.ensure_active_adapter("policy", name)
        scoring = data.select(keys=["sequences", "attention_mask"], metadata_keys=["response_length"])
        if self.run.trainer.step_style == "tinker":
            if data.get("rollout_logprobs") is None:
                raise RuntimeError(f"tenant {name}: clora.step_style=tinker needs the sampler's log-probs; the "
                                   "generator returned none")
            data["action_log_probs"] = data["rollout_logprobs"]
        else:
            with _timed(seconds, "recompute_s"):
                data["action_log_probs"] = behaviour_logprobs(dispatch, scoring, name,
                                                              mini_batch_boundaries(data, dispatch.cfg))
        if algorithm.use_kl_loss or algorithm.use_kl_in_reward:
            with _timed(seconds, "reference_s"):
                data["base_action_log_probs"] = reference_logprobs(dispatch, scoring)
        reward_kl = {}
        if algorithm.use_kl_in_reward:  # as RayPPOTrainer: penalise the rewards, then the advantages again
            if self.run.trainer.step_style == "skyrl":
                policy = data["action_log_probs"]
            else:
                with _timed(seconds, "recompute_s"):
                    policy = _response_logprobs(dispatch, scoring, name)
            penalty, kl_metrics = kl_reward_penalty(policy, data["base_action_log_probs"], data["loss_mask"], algorithm)
            reward_kl["avg_kl"] = kl_metrics["avg_kl"]
            data["rewards"] = data["rewards"] - penalty
            data["advantages"], data["returns"] = _advantages(data, algorithm)
        data["advantages"] = _mini_batch_advantages(data, dispatch.cfg)
        boundaries = mini_batch_boundaries(data, dispatch.cfg)
        steps: dict[str, list[float]] = defaultdict(list)
        for _ in range(dispatch.cfg.trainer.update_epochs_per_batch):
            for start, end in boundaries:  # as RayPPOTrainer._execute_training_step: one optimizer step each
                for key, value in self._optimizer_step(tenant, _rows(data, start, end), seconds).items():
                    steps[key].append(value)
        metrics = reduce_metrics(steps)  # SkyRL's reduction over a step's mini-batches and epochs: the mean
        metrics["optimizer_steps"] = float(len(boundaries) * dispatch.cfg.trainer.update_epochs_per_batch)
        return {**metrics, **reward_kl, **seconds}

    def _optimizer_step(self, tenant: Tenant, mini: TrainingInputBatch, seconds: dict[str, float]) -> dict[str, float]:
        """``forward_backward`` + ``optim_step`` of one mini-batch with the tenant's ``model_id`` at its scheduled LR
        (sent first on Megatron), their wall seconds added to ``seconds``; the step's metrics, checked against the
        worker's reports."""
        name, dispatch = tenant.spec.name, tenant.dispatch
        lr = tenant.schedule.lr(tenant.steps_done)
        if self.stack.strategy == "megatron":
            with _timed(seconds, "optim_s"):
                dispatch.set_lr("policy", lr, model_id=name)
        with _timed(seconds, "forward_backward_s"):
            output = dispatch.forward_backward("policy", mini, model_id=name)
        with _timed(seconds, "optim_s"):
            grad_norm = dispatch.optim_step("policy", model_id=name)
        tenant.steps_done += 1
        metrics = self.stack.step_metrics(name, output.metrics, grad_norm)
        check_step_report(name, lr, grad_norm, output.metrics, metrics, self.stack.strategy)
        return metrics

    async def publish(self, tenant: str, update: Update) -> int:
        """The workers' adapter of the tenant (``update``'s, which they hold) to the servers: :meth:`_sync`."""
        return await self._sync(tenant)

    async def _sync(self, tenant: str) -> int:
        """``save_weights_for_sampler`` (in a worker thread: the dispatch blocks on Ray), then the check that the
        servers hold the version the dispatch counted; returns that version."""
        handles = self.tenants[tenant]
        await asyncio.to_thread(asyncio.run, handles.dispatch.save_weights_for_sampler(model_id=tenant))
        held = self.stack.server_version(tenant)
        if held is not None and held != handles.view.weight_version:
            raise RuntimeError(f"tenant {tenant}: the servers hold adapter version {held} but the dispatch "
                               f"counted {handles.view.weight_version}")
        return handles.view.weight_version

    async def export(self, tenant: str, out_dir: Path) -> None:
        """A copy of the folder the tenant's last sync wrote."""
        shutil.copytree(Path(self.stack.sync_path) / tenant, out_dir, dirs_exist_ok=True)

    async def save(self, tenant: str, folder: Path) -> None:
        """The worker writes the tenant's training state (the tenant is between steps: no update runs for it)."""
        await asyncio.to_thread(self.stack.worker_call, "save_tenant_state", tenant, str(folder))
        await self.export(tenant, folder / "adapter")

    async def restore(self, tenant: str, folder: Path, version: int) -> None:
        """The worker reads the tenant's training state; its adapter becomes the tenant's sync folder (what
        :meth:`export` copies) and goes to the servers as ``version``."""
        synced = Path(self.stack.sync_path) / tenant
        async with self._update_lock:
            self.tenants[tenant].steps_done = await asyncio.to_thread(
                self.stack.worker_call, "load_tenant_state", tenant, str(folder))
            shutil.copytree(folder / "adapter", synced, dirs_exist_ok=True)
            await self.stack.publish_as(tenant, synced, version)

    async def end_training(self, tenant: str) -> None:
        """Nothing waits for a tenant here: each trains under the update lock when its batch is ready."""

    async def remove(self, tenant: str) -> None:
        async with self._update_lock:
            await asyncio.to_thread(self.tenants[tenant].dispatch.delete_adapter, "policy", tenant)
        await self.stack.unload(tenant)


@contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Adds the wall seconds the ``with`` body takes to ``seconds[phase]``."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] += time.perf_counter() - started


def _response_logprobs(dispatch: WorkerDispatch, scoring: TrainingInputBatch, model_id: str) -> torch.Tensor:
    """SkyRL's policy ``forward`` of ``scoring``'s rows under ``model_id``'s adapter: ``[B, response_length]``
    right-aligned log-probs, as ``RayPPOTrainer.fwd_logprobs_values_reward`` stacks them."""
    output = dispatch.forward("policy", scoring, model_id=model_id)
    return loss_fn_outputs_to_tensor(output.loss_fn_outputs)[: scoring["sequences"].shape[0]]


def behaviour_logprobs(dispatch: WorkerDispatch, scoring: TrainingInputBatch, model_id: str,
                       boundaries: list[tuple[int, int]]) -> torch.Tensor:
    """The behaviour policy's (``model_id``'s) response log-probs of ``scoring``'s rows, as
    ``RayPPOTrainer._execute_forward_pass`` computes them: with ``trainer.recompute_old_logprobs_per_minibatch`` and
    more than one policy mini-batch (``boundaries``), one forward per mini-batch over SkyRL's staged per-DP chunks
    (``stage_data`` + ``forward_from_staged``: the partition each mini-batch's ``forward_backward`` sees), rows in
    batch order; else one forward over the batch."""
    if not (dispatch.cfg.trainer.recompute_old_logprobs_per_minibatch and len(boundaries) > 1):
        return _response_logprobs(dispatch, scoring, model_id)
    outputs: list[dict[str, Any]] = []
    for chunk_refs in dispatch.stage_data("policy", scoring, boundaries):
        outputs.extend(dispatch.forward_from_staged("policy", chunk_refs, model_id=model_id).loss_fn_outputs)
    return loss_fn_outputs_to_tensor(outputs)[: scoring["sequences"].shape[0]]


def reference_logprobs(dispatch: WorkerDispatch, scoring: TrainingInputBatch) -> torch.Tensor:
    """The KL reference's (``REFERENCE_MODEL_ID``: the frozen base) response log-probs of ``scoring``'s rows at the
    temperature SkyRL's reference worker scores at (``RefWorkerBase._forward_micro_batch``: 1, or
    ``trainer.algorithm.temperature`` with ``enable_sample_support_replay``), while the policy workers' ``forward``
    divides the logits by ``trainer.algorithm.temperature``: when the two differ, the policy workers' algorithm
    temperature is the reference's for the call (``WorkerDispatch.set_algorithm_config``) and the run's again after
    it, also when it fails."""
    algorithm = dispatch.cfg.trainer.algorithm
    run_temperature = algorithm.temperature
    temperature = run_temperature if algorithm.enable_sample_support_replay else 1.0
    if temperature == run_temperature:
        return _response_logprobs(dispatch, scoring, REFERENCE_MODEL_ID)
    dispatch.set_algorithm_config("policy", temperature=temperature)
    try:
        return _response_logprobs(dispatch, scoring, REFERENCE_MODEL_ID)
    finally:
        dispatch.set_algorithm_config("policy", temperature=run_temperature)


LR_REPORT_REL_TOL = 1e-6
"""How far (relative) a worker's reported LR may be from the tenant's scheduled one: SkyRL's FSDP and Megatron
workers all-reduce their metrics as float32 tensors (``all_reduce_metrics``), so ``policy_lr`` comes back rounded to
float32 (relative spacing 2**-23, about 1.2e-7), and a mean over data-parallel ranks may round once more. 1e-6
covers that with room and still tells apart any two distinct LRs a schedule or two tenants would give."""


def check_step_report(tenant: str, lr: float, grad_norm: float | None, forward_backward: dict[str, float],
                      metrics: dict[str, float], strategy: str) -> None:
    """Raises unless the worker's reports are of this step: the LR its ``forward_backward`` ran with
    (``policy_lr``, SkyRL's metric) and the step metrics' ``lr`` are the tenant's scheduled ``lr`` (within
    :data:`LR_REPORT_REL_TOL`: SkyRL reduces them as float32), and, on the embedded worker, whose step metrics are
    its own record, their ``grad_norm`` is the one ``optim_step`` returned, exactly (SkyRL's FSDP and Megatron
    workers report a step's gradient norm once, as ``optim_step``'s result)."""
    reported = {"policy_lr": forward_backward.get("policy_lr"), "lr": metrics.get("lr")}
    if strategy == "embedded":
        reported["grad_norm"] = metrics.get("grad_norm")
    expected = {"policy_lr": lr, "lr": lr, "grad_norm": grad_norm}

    def agrees(key: str, value: float | None) -> bool:
        if key == "grad_norm" or value is None or expected[key] is None:
            return value == expected[key]
        return math.isclose(value, expected[key], rel_tol=LR_REPORT_REL_TOL, abs_tol=0.0)

    wrong = {key: value for key, value in reported.items() if not agrees(key, value)}
    if wrong:
        raise RuntimeError(f"tenant {tenant}: the worker reports {wrong} for this step; the driver expected "
                           f"{ {key: expected[key] for key in wrong} }")


def training_input(output: dict[str, Any], groups: list[str], pad_token_id: int,
                   algorithm: AlgorithmConfig) -> TrainingInputBatch:
    """SkyRL's ``TrainingInputBatch`` for a generator output, as ``RayPPOTrainer.convert_to_training_input``
    builds it (outcome reward on the last response token; ``metadata["uids"]`` = GRPO groups), plus the
    ``advantages`` SkyRL's policy workers read, from SkyRL's estimator (``algorithm``). The behaviour and
    reference log-probs are added per step (``SkyRLBackend._train``). The embedded worker recomputes
    advantages itself from ``rewards`` and ``uids``."""
    rewards = [r if isinstance(r, list) else [0.0] * (len(ids) - 1) + [float(r)]
               for r, ids in zip(output["rewards"], output["response_ids"])]
    sequences, attention, response_mask, token_rewards, loss_mask, logprobs, _, _ = convert_prompts_responses_to_batch_tensors(
        pad_token_id, output["prompt_token_ids"], output["response_ids"], rewards, output["loss_masks"],
        output.get("rollout_logprobs"),
    )
    data = TrainingInputBatch({
        "sequences": sequences, "attention_mask": attention, "response_mask": response_mask,
        "rewards": token_rewards, "loss_mask": loss_mask, "rollout_logprobs": logprobs,
    })
    data.metadata = {"uids": list(groups), "response_length": response_mask.shape[1]}
    data["advantages"], data["returns"] = _advantages(data, algorithm)
    return data


def _advantages(data: TrainingInputBatch, algorithm: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL's advantages and returns of ``data``'s token-level rewards, grouped by ``metadata["uids"]``."""
    return compute_advantages_and_returns(
        token_level_rewards=data["rewards"], response_mask=data["response_mask"], index=list(data.metadata["uids"]),
        adv_estimator=algorithm.advantage_estimator, config=algorithm, values=None, gamma=algorithm.gamma,
        lambd=algorithm.lambd, grpo_norm_by_std=algorithm.grpo_norm_by_std,
    )


def mini_batch_boundaries(data: TrainingInputBatch, cfg: Any) -> list[tuple[int, int]]:
    """SkyRL's policy mini-batches of ``data`` (``compute_prompt_mini_batch_boundaries`` over ``metadata["uids"]``):
    ``cfg.trainer.policy_mini_batch_size`` consecutive prompts each, in batch order. The batch's own prompt count
    stands for ``train_batch_size`` (a tenant's step holds that many; the sanity checks stay SkyRL's)."""
    uids = list(data.metadata["uids"])
    prompts = len(dict.fromkeys(uids))
    mini = min(cfg.trainer.policy_mini_batch_size, prompts)
    if prompts % mini:
        raise ValueError(f"trainer.policy_mini_batch_size={mini} must divide the step's {prompts} prompts; set it to "
                         "a divisor of trainer.train_batch_size")
    return compute_prompt_mini_batch_boundaries(uids, mini, prompts, cfg.generator.step_wise_trajectories,
                                                cfg.generator.n_samples_per_prompt)


def _mini_batch_advantages(data: TrainingInputBatch, cfg: Any) -> torch.Tensor:
    """``data["advantages"]`` as ``RayPPOTrainer._normalize_advantages`` leaves them for the policy: with
    ``advantage_batch_normalize`` z-scored over the batch, then each mini-batch's scaled by its loss reduction
    (:func:`~skyrl_clora.trainer.loss_reduction.reduce_advantages`)."""
    algorithm = cfg.trainer.algorithm
    advantages, mask = data["advantages"], data["response_mask"]
    if algorithm.advantage_batch_normalize:  # SkyRL's step 1, verbatim
        mean = advantages.mean()
        std = ((advantages - mean).pow(2) * mask).sum()
        advantages = (advantages - mean) * (std / mask.sum()).clamp(min=1e-8).rsqrt()
    minis = [list(range(start, end)) for start, end in mini_batch_boundaries(data, cfg)]
    return reduce_advantages(advantages, data["loss_mask"], [str(u) for u in data.metadata["uids"]], minis,
                             algorithm, cfg.trainer.micro_train_batch_size_per_gpu)


def _rows(data: TrainingInputBatch, start: int, end: int) -> TrainingInputBatch:
    """Rows ``start:end`` of ``data`` with their own ``metadata["uids"]`` (a slice shares the batch's metadata)."""
    mini = data[start:end]
    mini.metadata = {**data.metadata, "uids": list(data.metadata["uids"])[start:end]}
    return mini


async def _run_tenants(run: RunConfig, backend: SkyRLBackend, sources: dict[str, TaskSource], metrics: MetricsLog,
                       resume: dict[str, TenantCheckpoint], stopped: list[str]) -> None:
    refuse_adds = ("adding tenants to a live run needs backend=embedded (backend=skyrl translates every tenant's "
                   "SkyRL config at start)")
    try:
        await run_tenant_pool(run, backend, list(backend.plan.tenants), sources, metrics, resume, stopped, refuse_adds)
    finally:
        for client in [backend.stack.client, *backend.stack.views.values()]:
            await client.teardown()


def run_skyrl(run: RunConfig, plan: SkyRLPlan, sources: dict[str, TaskSource],
              resume: dict[str, TenantCheckpoint], stopped: list[str]) -> PoolOutcome:
    """Runs every tenant concurrently through SkyRL's stack on the base model the plan names, on its task data
    ``sources`` (by tenant name, ``recipes.plugin.build_task_sources``), those in ``resume`` from their
    checkpoints; writes the embedded backend's outputs and returns the run's records and summary fields for
    :func:`~skyrl_clora.metrics.summarize_pool`, among them ``cold_start_seconds`` (the stack's build),
    ``cold_start_parts_seconds`` (its parts: ``SkyRLStack.build_seconds``), ``register_seconds`` (by tenant: its
    adapter slot and first sync) and ``worker_allocator`` (the FSDP2 worker's allocator counters at the end)."""
    model_path = resolve_model_path(run)
    for line in plan.substitutions:
        print(f"[skyrl] stand-in: {line}", flush=True)
    started = time.perf_counter()
    metrics = MetricsLog.for_run(run, resumed_records(resume, list(plan.tenants)))
    stack = build_stack(run, plan, model_path)
    try:
        cold_start_s = time.perf_counter() - started
        backend = SkyRLBackend(run, plan, stack)
        asyncio.run(_run_tenants(run, backend, sources, metrics, resume, stopped))
        worker_allocator = stack.worker_allocator_stats()
    finally:
        metrics.close()
        stack.shutdown()
    fields = {
        "backend": "skyrl", "mode": run.mode, "steps": run.steps, "model_path": model_path,
        "inference_backend": plan.inference_backend, "strategy": plan.strategy, "substitutions": list(plan.substitutions),
        "cold_start_seconds": [cold_start_s], "cold_start_parts_seconds": stack.build_seconds,
        "register_seconds": backend.register_seconds,
        "engine": stack.engine_stats(), "worker_allocator": worker_allocator,
    }
    return PoolOutcome(metrics.records, fields, "backend=skyrl")
