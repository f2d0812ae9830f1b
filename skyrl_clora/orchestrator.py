"""Tenant loops over the shared services, in concurrent mode (all at once) or serial mode (the baseline).

A tenant loop is SkyRL's RL step parameterised by the tenant: its ``SkyRLGymGenerator`` (``model=`` its
adapter) produces episodes through the shared sampler, SkyRL's GRPO advantage and policy loss train its
adapter through the AdapterStore, and the sync publishes the new version in place. A tenant that raises
(e.g. its reward function) is marked failed and logged; the others run on.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import asdict
from typing import Any

import torch
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
from skyrl.train.config import SamplingParams as SkyRLSamplingParams
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

from skyrl_clora.config import RunConfig
from skyrl_clora.episodes import episode_batch, eval_record, log_orphaned_task_error, scalar_reward, step_record
from skyrl_clora.lora.peft_export import init_adapter, save_peft_adapter
from skyrl_clora.metrics import MetricsLog, write_run_summary
from skyrl_clora.recipes.tasks import TaskSource, build_task_sources
from skyrl_clora.services import Services, build_services, resolve_model_path
from skyrl_clora.tenants import TenantSpec
from skyrl_clora.trainer.adapter_store import LRSchedule
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.scheduler import TrainScheduler

logger = logging.getLogger("skyrl_clora")


class TenantLoop:
    """One tenant's experiment: evaluation, ``steps`` RL steps, final evaluation, PEFT export."""

    def __init__(self, run: RunConfig, spec: TenantSpec, source: TaskSource, services: Services, metrics: MetricsLog,
                 train_scheduler: TrainScheduler) -> None:
        self.run = run
        self.spec = spec
        self.source = source
        self.services = services
        self.metrics = metrics
        self.train_scheduler = train_scheduler
        recipe = run.recipe
        generator_cfg = GeneratorConfig(
            max_turns=recipe.max_turns,
            batched=False,
            max_input_length=recipe.max_input_length,
            n_samples_per_prompt=spec.samples_per_prompt,
            use_conversation_multi_turn=True,
            sampling_params=SkyRLSamplingParams(
                max_generate_length=recipe.max_generate_length, temperature=run.sampler.temperature,
                top_p=run.sampler.top_p, logprobs=1,
            ),
        )
        # Extra environment arguments of every episode; an LLM customer needs env steps off the event loop.
        self.env_args: dict[str, Any] = {}
        env_workers = 0
        if recipe.name == "taubench" and recipe.user == "llm":
            self.env_args["user_factory"] = self._llm_user
            env_workers = 8
        self.generator = SkyRLGymGenerator(
            generator_cfg, SkyRLGymConfig(max_env_workers=env_workers), services.client, services.tokenizer,
            policy_model_name=spec.name,
        )

    def _llm_user(self) -> Any:
        """A tau-bench customer played by the base model (no adapter) through the shared sampler."""
        from skyrl_clora.recipes.taubench.users import LLMUser

        async def generate(messages: list[dict[str, str]]) -> str:
            conversation = json.dumps(messages, sort_keys=True).encode()
            body = {"messages": messages, "max_tokens": self.run.recipe.max_generate_length,
                    "user": f"customer-{self.spec.name}-{hashlib.sha256(conversation).hexdigest()[:16]}"}
            response = await self.services.client.chat_completion({"json": body})
            return response["choices"][0]["message"]["content"]

        return LLMUser(generate, loop=asyncio.get_running_loop())

    def register(self) -> None:
        """Creates the tenant's adapter (seeded PEFT init) in the trainer's store and the sampler."""
        generator = torch.Generator().manual_seed(self.spec.seed)
        weights = init_adapter(self.services.trainer.layers, self.spec.rank, self.spec.alpha, generator)
        schedule = LRSchedule(self.spec.lr, self.run.trainer.warmup_steps, self.run.steps, self.run.trainer.lr_schedule)
        self.services.store.register(self.spec.name, weights, schedule, seed=self.spec.seed)
        self.services.sync.register(self.spec.name, self.services.store.tenants[self.spec.name].weights)

    async def run_experiment(self) -> None:
        name = self.spec.name
        try:
            await self._evaluate(step=0)
            for step in range(1, self.run.steps + 1):
                await self._rl_step(step)
            await self._evaluate(step=self.run.steps)
            save_peft_adapter(self.services.store.tenants[name].weights, self.run.output_dir / "adapters" / name,
                              self.services.model_path)
        except Exception as error:  # noqa: BLE001 - a failing tenant must not take the others down
            logger.exception("tenant %s failed", name)
            self.metrics.write({"event": "failed", "tenant": name, "error": f"{type(error).__name__}: {error}"})
            await self.services.sync.unregister(name)
            self.services.store.remove(name)

    async def _generate(self, rows: list[dict[str, Any]], samples: int, tag: str) -> tuple[dict, list[str]]:
        """Runs ``samples`` episodes per row through SkyRL's generator; returns its output and group ids."""
        batch, trajectory_ids, groups = episode_batch(self.spec.name, rows, samples, tag, self.env_args)
        output = await self.generator.generate(batch, disable_tqdm=True)
        for trajectory in trajectory_ids:
            versions = self.services.client.versions_for(self.spec.name, trajectory.to_string())
            self.services.sync.check_sampled_with(self.spec.name, versions)
        return output, groups

    async def _evaluate(self, step: int) -> None:
        rows = self.source.evaluation_rows()
        if rows:
            output, _ = await self._generate(rows, samples=1, tag=f"eval{step}")
            self.metrics.write(eval_record(self.spec.name, step, output))

    async def _rl_step(self, step: int) -> None:
        name = self.spec.name
        started = time.perf_counter()
        output, groups = await self._generate(
            self.source.step_rows(step - 1, self.run.recipe.prompts_per_step), self.spec.samples_per_prompt, f"s{step}"
        )
        rollout_s = time.perf_counter() - started
        batch = TrainBatch(
            prompt_ids=output["prompt_token_ids"], response_ids=output["response_ids"], loss_masks=output["loss_masks"],
            rewards=[scalar_reward(r) for r in output["rewards"]], group_ids=groups,
            rollout_logprobs=output.get("rollout_logprobs"),
        )
        started = time.perf_counter()
        weights, train_metrics = await self.train_scheduler.train(name, batch)
        train_s = time.perf_counter() - started
        version, sync_s = await self.services.sync.publish(name, weights)
        timings = {"rollout_s": rollout_s, "train_s": train_s, "sync_s": sync_s}
        self.metrics.write(step_record(name, step, version, output, timings, train_metrics))


async def _run_group(run: RunConfig, specs: list[TenantSpec], sources: dict[str, TaskSource], services: Services,
                     metrics: MetricsLog) -> None:
    asyncio.get_running_loop().set_exception_handler(log_orphaned_task_error)
    scheduler = services.train_scheduler(run)
    loops = [TenantLoop(run, spec, sources[spec.name], services, metrics, scheduler) for spec in specs]
    for loop in loops:
        loop.register()
    await asyncio.gather(*(loop.run_experiment() for loop in loops))


def run_experiments(run: RunConfig) -> dict[str, Any]:
    """Runs every tenant in ``run.mode``; writes metrics.jsonl, summary.json, reward_curves.png, adapters/."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    specs = list(run.tenants)
    sources = build_task_sources(run.recipe, specs, run.steps, run.seed)
    base_started = time.perf_counter()
    model_path = resolve_model_path(run)
    base_model_s = time.perf_counter() - base_started
    started = time.perf_counter()
    metrics = MetricsLog(run.output_dir / "metrics.jsonl", progress=run.progress)
    rows_per_tenant = run.recipe.prompts_per_step * max(spec.samples_per_prompt for spec in specs)
    cold_starts: list[float] = []
    engine_stats: list[dict[str, float]] = []
    try:
        if run.mode == "concurrent":
            services = build_services(run, model_path, len(specs), rows_per_tenant)
            cold_starts.append(services.cold_start_seconds)
            try:
                asyncio.run(_run_group(run, specs, sources, services, metrics))
            finally:
                services.shutdown()
                engine_stats.append(asdict(services.engine.stats))
        else:
            for spec in specs:
                services = build_services(run, model_path, 1, rows_per_tenant)
                cold_starts.append(services.cold_start_seconds)
                try:
                    asyncio.run(_run_group(run, [spec], sources, services, metrics))
                finally:
                    services.shutdown()
                    engine_stats.append(asdict(services.engine.stats))
    finally:
        metrics.close()
    wall_s = time.perf_counter() - started
    fields = {
        "mode": run.mode, "steps": run.steps, "model_path": model_path, "cold_start_seconds": cold_starts,
        "engine": {key: sum(stats[key] for stats in engine_stats) for key in engine_stats[0]} if engine_stats else {},
    }
    return write_run_summary(run.output_dir, metrics.records, specs, fields, wall_s, base_model_s, f"mode={run.mode}")
