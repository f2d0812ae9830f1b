"""The embedded backend: the tenant loop over the project's own services, in concurrent mode (all tenants on
one set of services) or serial mode (one tenant after another, each with its own cold start: the baseline).

A tenant's episodes run through SkyRL's ``SkyRLGymGenerator`` (``model=`` its adapter) against the shared
sampler; its updates go through the :class:`~skyrl_clora.trainer.scheduler.TrainScheduler` (swap or packed
passes over the AdapterStore, with SkyRL's GRPO advantage and policy loss); the sync publishes each new
version in place (:class:`~skyrl_clora.backends.embedded.sync.AdapterSync`).
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
from skyrl.train.config import SamplingParams as SkyRLSamplingParams
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

from skyrl_clora.backends.embedded.memory_plan import available_host_memory, check_tenant_host_memory
from skyrl_clora.backends.embedded.services import Services, build_services, release_device_memory
from skyrl_clora.backends.engine_builder import step_rows
from skyrl_clora.base_model import resolve_model_path
from skyrl_clora.checkpoints import TenantCheckpoint, resumed_records
from skyrl_clora.config.checks import algorithm_config
from skyrl_clora.config.schema import RunConfig
from skyrl_clora.control.interrupts import STOP
from skyrl_clora.lora.peft_export import init_adapter, save_peft_adapter
from skyrl_clora.metrics import MetricsLog, PoolOutcome
from skyrl_clora.recipes.plugin import TaskSource, load_recipe
from skyrl_clora.tenant_loop import PoolHost, Rollout, Update, episode_batch, run_tenant_pool, scalar_reward
from skyrl_clora.tenants import TenantSpec
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.state_io import read_tenant_state, write_tenant_state


class EmbeddedBackend:
    """:class:`~skyrl_clora.tenant_loop.TenantBackend` over one set of :class:`Services` (see module docstring)."""

    def __init__(self, run: RunConfig, services: Services) -> None:
        self.run = run
        self.services = services
        self.scheduler = services.train_scheduler(run)
        self._generators: dict[str, SkyRLGymGenerator] = {}
        self._env_args: dict[str, dict[str, Any]] = {}

    async def register(self, spec: TenantSpec) -> None:
        """Seeded PEFT init into the trainer's store and the sampler (version 0); the tenant's generator. ConfigError when
        its trainer state does not fit the host memory available now (:func:`check_tenant_host_memory`)."""
        services, run = self.services, self.run
        check_tenant_host_memory(services.store, [spec.rank], available_host_memory())
        weights = init_adapter(services.trainer.layers, spec.rank, spec.alpha, torch.Generator().manual_seed(spec.seed))
        # SkyRL's scheduler counts optimizer steps: num_training_steps = RL steps * policy_steps_per_train_batch
        schedule = LRSchedule(spec.lr, run.trainer.num_warmup_steps, run.steps * run.optimizer_steps_per_rl_step,
                              run.trainer.scheduler)
        overrides = spec.algorithm_overrides()  # the tenant's own SkyRL algorithm keys (tenants.PER_TENANT_SKYRL)
        if spec.temperature is not None and run.trainer.algorithm.get("temperature") == run.sampler.temperature:
            overrides["temperature"] = spec.temperature  # the trainer's follows its sampling temperature, as SkyRL's
        algorithm = algorithm_config({**run.trainer.algorithm, **overrides}) if overrides else None
        services.store.register(spec.name, weights, schedule, seed=spec.seed, algorithm=algorithm,
                                weight_decay=spec.weight_decay, max_grad_norm=spec.max_grad_norm)
        services.sync.register(spec.name, services.store.tenants[spec.name].weights)
        self.scheduler.join(spec.name)
        episode_env = load_recipe(run.recipe.name).episode_env(run.recipe, spec, self._base_model_chat)
        self._env_args[spec.name] = episode_env.args
        self._generators[spec.name] = SkyRLGymGenerator(
            generator_config(run, spec), SkyRLGymConfig(max_env_workers=episode_env.workers), services.client,
            services.tokenizer, policy_model_name=spec.name,
        )

    async def _base_model_chat(self, messages: list[dict[str, str]], max_tokens: int, user: str) -> str:
        """A chat completion by the base model (no adapter) through the shared sampler (a recipe's simulated
        user); ``user`` seeds its sampling."""
        body = {"messages": messages, "max_tokens": max_tokens, "user": user}
        response = await self.services.client.chat_completion({"json": body})
        return response["choices"][0]["message"]["content"]

    async def sample(self, spec: TenantSpec, rows: list[dict[str, Any]], samples: int, tag: str,
                     sampling_params: dict[str, Any] | None = None) -> Rollout:
        """The tenant's episodes; its requests carry ``sampling_params`` when given (evaluation's), else, with its
        own ``temperature`` or ``top_p``, its generator's sampling params (else the engine client's, the run's)."""
        generator = self._generators[spec.name]
        own = spec.temperature is not None or spec.top_p is not None
        sampling = sampling_params or (asdict(generator.generator_cfg.sampling_params) if own else None)
        batch, trajectory_ids, groups = episode_batch(spec.seed, rows, samples, tag, self._env_args[spec.name],
                                                      sampling)
        output = await generator.generate(batch, disable_tqdm=True)
        versions = [self.services.client.versions_for(spec.name, t.to_string()) for t in trajectory_ids]
        return Rollout(output, groups, trajectory_ids, versions)

    def version(self, tenant: str) -> int:
        return self.services.sync.version(tenant)

    def exclusive_update(self, tenant: str) -> AbstractAsyncContextManager:
        """Nothing to hold: the train scheduler orders (or packs) the tenants' passes itself."""
        return contextlib.nullcontext()

    async def train(self, tenant: str, rollout: Rollout) -> Update:
        """The tenant's update on its episodes; with ``clora.step_style=tinker`` the PPO ratio's behaviour
        log-probs are the sampler's, else the trainer recomputes them (see ``trainer.trainer``)."""
        output = rollout.output
        sampler_logprobs = output.get("rollout_logprobs")
        if self.run.trainer.step_style == "tinker" and sampler_logprobs is None:
            raise RuntimeError(f"tenant {tenant}: clora.step_style=tinker needs the sampler's log-probs; "
                               "the generator returned none")
        batch = TrainBatch(
            prompt_ids=output["prompt_token_ids"], response_ids=output["response_ids"], loss_masks=output["loss_masks"],
            rewards=[scalar_reward(r) for r in output["rewards"]], group_ids=rollout.groups,
            rollout_logprobs=sampler_logprobs,
            old_logprobs=sampler_logprobs if self.run.trainer.step_style == "tinker" else None,
        )
        weights, metrics = await self.scheduler.train(tenant, batch)
        return Update(metrics, weights)

    async def publish(self, tenant: str, update: Update) -> int:
        version, _ = await self.services.sync.publish(tenant, update.weights)
        return version

    async def export(self, tenant: str, out_dir: Path) -> None:
        save_peft_adapter(self.services.store.tenants[tenant].weights, out_dir, self.services.model_path)

    async def save(self, tenant: str, folder: Path) -> None:
        write_tenant_state(self.services.store, tenant, folder)
        await self.export(tenant, folder / "adapter")

    async def restore(self, tenant: str, folder: Path, version: int) -> None:
        read_tenant_state(self.services.store, tenant, folder)
        await self.services.sync.publish_as(tenant, self.services.store.tenants[tenant].weights, version)

    async def end_training(self, tenant: str) -> None:
        self.scheduler.leave(tenant)

    async def remove(self, tenant: str) -> None:
        self.scheduler.leave(tenant)
        await self.services.sync.unregister(tenant)
        self.services.store.remove(tenant)


def generator_config(run: RunConfig, spec: TenantSpec) -> GeneratorConfig:
    """The SkyRL ``GeneratorConfig`` of tenant ``spec``'s episodes: the run's generator keys (``max_turns``,
    ``max_input_length``, ``chat_template_kwargs``, which SkyRL's generator passes to every ``apply_chat_template``),
    non-batched, and the tenant's sampling params (its temperature and top_p overrides, else the run's)."""
    recipe = run.recipe
    return GeneratorConfig(
        max_turns=recipe.max_turns, batched=False, max_input_length=recipe.max_input_length,
        n_samples_per_prompt=spec.samples_per_prompt, use_conversation_multi_turn=True,
        chat_template_kwargs=dict(recipe.chat_template_kwargs),
        sampling_params=SkyRLSamplingParams(
            max_generate_length=recipe.max_generate_length,
            temperature=run.sampler.temperature if spec.temperature is None else spec.temperature,
            top_p=run.sampler.top_p if spec.top_p is None else spec.top_p, logprobs=1,
        ),
    )


def run_experiments(run: RunConfig, sources: dict[str, TaskSource], resume: dict[str, TenantCheckpoint],
                    stopped: list[str], host: PoolHost | None = None) -> PoolOutcome:
    """Runs every tenant in ``run.mode`` on its task data ``sources`` (by tenant name,
    ``recipes.plugin.build_task_sources``), those in ``resume`` from their checkpoints, those in ``stopped`` not
    (stopped through the control endpoint); writes metrics.jsonl, summary.json, reward_curves.png, adapters/
    and checkpoints (into ``run.output_dir``, which ``checkpoints.claim_output_dir`` made). In concurrent mode
    tenants can be added while the run goes (``control``), and with ``host`` the run's pool stays open while
    ``host.serve`` runs (concurrent mode; a run with unfinished tenants). Returns the run's records and summary
    fields for :func:`~skyrl_clora.metrics.summarize_pool`; the fields' ``queue_wait_seconds``: each tenant's
    sampling requests' queue waits, submission to admission (requests, p50_s, p99_s, max_s)."""
    specs = list(run.tenants)
    model_path = resolve_model_path(run)
    metrics = MetricsLog.for_run(run, resumed_records(resume, specs))
    rows_per_tenant = step_rows(run, specs)
    unfinished = [spec for spec in specs if not (spec.name in resume and resume[spec.name].finished)]
    groups = ([unfinished] if unfinished else []) if run.mode == "concurrent" else [[spec] for spec in unfinished]
    cold_starts: list[float] = []
    engine_stats: list[dict[str, float]] = []
    queue_waits: dict[str, dict[str, float]] = {}
    try:
        for group in groups:
            if STOP.requested():  # before the group started (serial mode; a replica): it starts on resume
                for spec in group:
                    metrics.write({"event": "stopped", "tenant": spec.name,
                                   "step": resume[spec.name].step if spec.name in resume else 0})
                continue
            cold_starts.append(_run_group(run, group, sources, model_path, rows_per_tenant, metrics, engine_stats,
                                          queue_waits, resume, stopped, host))
            release_device_memory()
    finally:
        metrics.close()
    fields = {
        "mode": run.mode, "steps": run.steps, "model_path": model_path, "cold_start_seconds": cold_starts,
        "engine": {key: sum(stats[key] for stats in engine_stats) for key in engine_stats[0]} if engine_stats else {},
        "queue_wait_seconds": queue_waits,
    }
    return PoolOutcome(metrics.records, fields, f"mode={run.mode}")


def _run_group(run: RunConfig, specs: list[TenantSpec], sources: dict[str, TaskSource], model_path: str,
               rows_per_tenant: int, metrics: MetricsLog, engine_stats: list[dict[str, float]],
               queue_waits: dict[str, dict[str, float]],
               resume: dict[str, TenantCheckpoint], stopped: list[str], host: PoolHost | None = None) -> float:
    """Runs ``specs`` on a set of services of their own (sized for ``run.tenant_capacity`` tenants in concurrent
    mode); appends the engine's stats, adds its tenants' queue waits (``EngineThread.queue_waits``) to
    ``queue_waits``; returns its cold start."""
    concurrent = run.mode == "concurrent"
    services = build_services(run, model_path, run.tenant_capacity if concurrent else len(specs), rows_per_tenant)
    refuse_adds = None if concurrent else "clora.mode=serial runs one tenant at a time; add tenants to a concurrent run"
    if run.trainer.pack_policy == "lockstep":
        refuse_adds = ("clora.pack_policy=lockstep packs a fixed set of tenants step by step; add tenants to a run with "
                       "clora.pack_policy=ready")
    try:  # every starting tenant's trainer state must fit the host before any registers
        check_tenant_host_memory(services.store, [spec.rank for spec in specs if spec.name not in stopped],
                                 available_host_memory())
        asyncio.run(run_tenant_pool(run, EmbeddedBackend(run, services), specs, sources, metrics, resume, stopped,
                                    refuse_adds, host))
    finally:
        services.shutdown()
        engine_stats.append(asdict(services.engine.stats))
        queue_waits.update(services.engine.queue_waits())
    return services.cold_start_seconds
