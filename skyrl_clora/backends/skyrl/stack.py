"""Builds the shared part of the ``backend=skyrl`` stack: inference servers + client, tenant views, Ray
and the policy worker group. Each half is production or its stand-in, per the plan:

- inference ``embedded``: one :class:`~skyrl_clora.sampler.engine.Engine` (one adapter slot per tenant)
  served by :class:`~skyrl_clora.backends.skyrl.server.EmbeddedServer` on 127.0.0.1, SkyRL's
  ``RemoteInferenceClient`` pointed at it (a ``BearerInferenceClient``, with the server's token). ``vllm``:
  SkyRL's ``build_new_inference_client`` starts the vLLM servers and router from the translated config (LoRA
  on, ``max_loras`` >= tenants per batch).
- training ``embedded``: SkyRL's ``PPORayActorGroup`` builds one
  :class:`~skyrl_clora.skyrl.worker.EmbeddedPolicyWorker` actor (``num_gpus_per_actor=0``) whose
  ``init_model`` loads the base model inside the actor, given every tenant's seed and learning rate.
  ``megatron``: SkyRL's Megatron policy worker with patch 0001's run-time form
  (:func:`~skyrl_clora.skyrl.worker_patches.with_per_tenant_lora_sync`: no prefix-cache reset on a
  tenant's sync whose requests were all salted) and per-tenant initial adapters, RNG, step counts and
  checkpoints over SkyRL's AdapterStore
  (:func:`~skyrl_clora.skyrl.megatron_checkpoints.with_megatron_tenant_checkpoints`, given every tenant's seed),
  initialised as SkyRL's Tinker backend does (LR driven through ``set_lr``, optimizer state primed, the
  pristine adapter snapshotted for ``register_adapter``).
  ``fsdp2`` (SkyRL's ``trainer.strategy=fsdp``): SkyRL's FSDP2 policy worker, one GPU per actor, with patch 0001's
  run-time form and a LoRA AdapterStore per worker (:func:`~skyrl_clora.skyrl.fsdp_tenants.with_fsdp_tenants`),
  given every tenant's seed and LR; each tenant runs SkyRL's scheduler from its own LR over the run's optimizer
  steps, and syncs through SkyRL's LoRA path (PEFT folder + ``load_lora_adapter``).

Ray: with the embedded engine and the embedded or FSDP2 workers, a small local Ray (``num_cpus=2``, no dashboard; the
FSDP2 workers get the environment SkyRL's ``initialize_ray`` gives them), whose loss and estimator registries' actors
start beside the workers; otherwise SkyRL's ``initialize_ray`` (its runtime environment for vLLM/Megatron). A Ray the
caller started is reused.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.backends.skyrl_train.workers.worker import PPORayActorGroup
from transformers.utils import logging as hf_logging

from skyrl_clora.backends.embedded.memory_plan import inference_only_blocks
from skyrl_clora.backends.engine_builder import (engine_config, engine_kv_blocks, engine_rows, engine_slot_count,
                                                 kv_cache_dtype, step_rows)
from skyrl_clora.base_model import checked_tokenizer, load_base_model, resolve_device
from skyrl_clora.config.schema import ConfigError, RunConfig
from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.placement.ray_session import RAY_SYSTEM_CONFIG, forget_stale_registry_actors, start_ray, sync_skyrl_registries
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.backends.skyrl.bearer_client import BearerInferenceClient
from skyrl_clora.backends.skyrl.config_translation import MEGATRON_WORKER_PACKAGES, SkyRLPlan, importable
from skyrl_clora.skyrl.fsdp_tenants import with_fsdp_tenants
from skyrl_clora.skyrl.megatron_checkpoints import with_megatron_tenant_checkpoints
from skyrl_clora.backends.skyrl.server import EmbeddedServer
from skyrl_clora.backends.skyrl.shared_gpu import held_by_other_processes, peak_pass_batch
from skyrl_clora.backends.skyrl.tenant_client import TenantInferenceClient, tenant_views
from skyrl_clora.skyrl.worker import EmbeddedPolicyWorker
from skyrl_clora.skyrl.worker_patches import with_per_tenant_lora_sync
from skyrl_clora.tenants import TenantSpec

FSDP_STRATEGIES = ("fsdp2", "fsdp")
"""The plan's names for SkyRL's FSDP2 policy workers (SkyRL 0.4's ``trainer.strategy=fsdp``)."""


@dataclass
class SkyRLStack:
    """What every tenant shares: tokenizer, inference servers and client, the views, the worker group."""

    tokenizer: Any
    client: RemoteInferenceClient
    views: dict[str, TenantInferenceClient]
    policy_group: PPORayActorGroup
    strategy: str
    sync_path: str
    owns_ray: bool
    engine: EngineThread | None = None
    server: EmbeddedServer | None = None
    server_setup: Any = None
    build_seconds: dict[str, float] = field(default_factory=dict)
    """The build's parts in wall seconds: ``ray`` (Ray's start, or none when the caller's Ray is reused),
    ``policy_workers`` (the actors and their ``init_model``), ``training_peak`` (the workers' measured pass, for the
    embedded engine's memory plan on a GPU) and ``inference`` (the engine or the vLLM servers, their server and
    client)."""
    _stopped: bool = field(default=False, repr=False)

    def server_version(self, tenant: str) -> int | None:
        """The adapter version the inference server holds for ``tenant`` (None: vLLM does not say)."""
        return self.engine.adapter_version(tenant) if self.engine is not None else None

    def step_metrics(self, tenant: str, forward_backward: dict[str, float], grad_norm: float | None) -> dict[str, float]:
        """The metrics of ``tenant``'s last step: the embedded worker's own (the Trainer's), or SkyRL's FSDP2/Megatron
        workers' ``forward_backward`` metrics with ``optim_step``'s gradient norm and, as ``lr``, the LR the worker's
        optimizer ran the step with (its ``policy_lr``)."""
        if self.strategy == "embedded":
            return self.worker_call("step_metrics", tenant)
        return {**forward_backward, "grad_norm": float(grad_norm or 0.0), "lr": forward_backward.get("policy_lr")}

    def worker_call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the policy worker (world size 1); its result. Blocks on Ray."""
        return ray.get(self.policy_group.async_run_ray_method("pass_through", method, *args))[0]

    async def publish_as(self, tenant: str, adapter_folder: Path, version: int) -> None:
        """Loads the PEFT adapter in ``adapter_folder`` as ``tenant``'s ``version`` (a resumed tenant's): into the
        embedded engine directly, or on vLLM's servers by name (which count their own versions)."""
        if self.engine is not None:
            weights = await asyncio.to_thread(load_peft_adapter, adapter_folder)
            await asyncio.wrap_future(self.engine.publish(tenant, weights, version))
        else:
            await self.client.load_lora_adapter(tenant, str(adapter_folder))
        self.views[tenant].resume_weight_version(version)

    async def unload(self, tenant: str) -> None:
        """Unloads a failed tenant's adapter from the servers once its requests are done."""
        while True:
            try:
                await self.client.unload_lora_adapter(tenant)
                return
            except Exception as error:  # noqa: BLE001 - 409 while its last requests finish; else give up
                if "in flight" not in str(error):
                    return
                await asyncio.sleep(0.05)

    def engine_stats(self) -> dict[str, float]:
        return asdict(self.engine.stats) if self.engine is not None else {}

    def worker_allocator_stats(self) -> dict[str, int]:
        """The FSDP2 worker's CUDA allocator counters (``allocator_stats``); empty for the other strategies."""
        return self.worker_call("allocator_stats") if self.strategy in FSDP_STRATEGIES else {}

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for info in self.policy_group.actor_infos:
            ray.kill(info.handle)
        if self.server is not None:
            self.server.stop()
        if self.engine is not None:
            self.engine.shutdown()
        if self.server_setup is not None:
            for group in [*self.server_setup.server_groups, *self.server_setup.prefill_server_groups,
                          *self.server_setup.decode_server_groups]:
                group.shutdown()
            if self.server_setup.router is not None:
                self.server_setup.router.shutdown()
        if self.owns_ray:
            ray.shutdown()


def _gpus_needed(plan: SkyRLPlan) -> int:
    placement, ie = plan.base.trainer.placement, plan.base.generator.inference_engine
    trained_on_gpus = plan.strategy == "megatron" or plan.strategy in FSDP_STRATEGIES
    gpus = placement.policy_num_nodes * placement.policy_num_gpus_per_node if trained_on_gpus else 0
    if plan.inference_backend == "vllm":
        gpus += ie.num_engines * ie.tensor_parallel_size * ie.pipeline_parallel_size * ie.data_parallel_size
    return gpus


def check_buildable(plan: SkyRLPlan) -> None:
    """Refuses, with the fix, a plan this machine cannot build (before anything starts)."""
    if plan.strategy == "megatron" and plan.inference_backend == "embedded":
        raise ConfigError("backend.strategy=megatron needs backend.inference_backend=vllm: SkyRL 0.4's Megatron "
                          "init_weight_sync_state imports vLLM and POSTs /init_weight_transfer_engine, which the "
                          "embedded server lacks (or use backend.strategy=embedded)")
    if plan.inference_backend == "vllm" and not importable("vllm"):
        raise ConfigError("backend.inference_backend=vllm but vllm is not installed; install vllm or set "
                          "backend.inference_backend=embedded (or auto)")
    missing = [module for module in MEGATRON_WORKER_PACKAGES if not importable(module)]
    if plan.strategy == "megatron" and missing:
        raise ConfigError(f"backend.strategy=megatron but SkyRL's Megatron worker imports {', '.join(missing)}, not "
                          "importable here; install megatron-core, Megatron-Bridge and TransformerEngine or set "
                          "backend.strategy=embedded (or auto)")
    if plan.strategy in FSDP_STRATEGIES:
        check_fsdp_buildable(plan)
    placement = plan.base.trainer.placement
    if placement.colocate_all:  # kept by the translation with vLLM only (the embedded server shares the GPUs awake)
        raise ConfigError("trainer.placement.colocate_all=true sleeps the vLLM servers for every sync; tenants sync in "
                          "place: set trainer.placement.colocate_all=false (or backend.inference_backend=embedded)")
    if plan.strategy == "embedded" and placement.policy_num_nodes * placement.policy_num_gpus_per_node != 1:
        raise ConfigError("backend.strategy=embedded runs one worker: set trainer.placement.policy_num_nodes=1 "
                          "trainer.placement.policy_num_gpus_per_node=1")
    gpus = _gpus_needed(plan)
    if gpus and placement.policy_num_nodes == 1 and torch.cuda.device_count() < gpus:
        raise ConfigError(f"backend=skyrl with inference_backend={plan.inference_backend} strategy={plan.strategy} needs "
                          f"{gpus} GPUs (not colocated); {torch.cuda.device_count()} visible: lower "
                          "trainer.placement.policy_num_gpus_per_node/generator.inference_engine.num_engines or use the "
                          "embedded stand-ins")


def check_fsdp_buildable(plan: SkyRLPlan) -> None:
    """Refuses, with the fix, what SkyRL's FSDP2 policy worker cannot run here (``check_buildable``'s FSDP part)."""
    trainer = plan.base.trainer
    if not torch.cuda.is_available():
        raise ConfigError("backend.strategy=fsdp2 runs SkyRL's FSDP2 workers on CUDA GPUs and none is visible; use "
                          "backend.strategy=embedded (or auto)")
    if not importable("flash_attn"):
        raise ConfigError("backend.strategy=fsdp2: SkyRL's FSDP model wrapper imports flash_attn.bert_padding; install "
                          "flash-attn or put benchmarks/device_stubs (its stand-in) on PYTHONPATH")
    if trainer.flash_attn or trainer.remove_microbatch_padding:
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            raise ConfigError("trainer.flash_attn/remove_microbatch_padding need flash-attn, which is not installed: "
                              "set trainer.flash_attn=false trainer.remove_microbatch_padding=false")
    if trainer.policy.model.lora.sync_mode != "disk":
        raise ConfigError("backend.strategy=fsdp2 syncs each tenant's adapter through disk: set "
                          "trainer.policy.model.lora.sync_mode=disk")


def _embedded_inference(run: RunConfig, plan: SkyRLPlan, model_path: str, tokenizer: Any,
                        group: PPORayActorGroup, seconds: _PhaseClock) -> tuple:
    """The embedded engine (:func:`serving_engine`) and its SkyRL-protocol server (started), and a client for it. On a
    GPU its KV cache gets what the memory plan leaves beside ``group``'s workers on the same GPU at their measured
    training peak (:mod:`skyrl_clora.backends.skyrl.shared_gpu`; its seconds set aside in ``seconds`` as
    ``training_peak``)."""
    device = resolve_device(run)

    def held_by_workers(model: torch.nn.Module, max_len: int) -> int:
        started = time.perf_counter()
        peaks = _training_peaks(plan, group, max_len, model.config.vocab_size, tokenizer.pad_token_id)
        seconds.aside("training_peak", time.perf_counter() - started)
        return held_by_other_processes(device, peaks)

    engine = serving_engine(run, list(plan.tenants), model_path, held_by_workers)
    server = EmbeddedServer(engine, tokenizer, model_name=model_path, seed=run.seed)
    try:
        url = server.start()
    except BaseException:
        engine.shutdown()
        raise
    client = BearerInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model_path,
                                   uses_lora_weight_sync=True, tokenizer=tokenizer, api_key=server.token)
    return client, engine, server


def serving_engine(run: RunConfig, tenants: list[TenantSpec], model_path: str,
                   held_elsewhere: Callable[[torch.nn.Module, int], int]) -> EngineThread:
    """The embedded server's engine, started: the base model with one adapter slot per tenant (``sampler.adapter_slots``)
    and rows for every tenant's step batch, every ``sampler.*`` key read as on ``backend=embedded``
    (:mod:`skyrl_clora.backends.engine_builder`). On a GPU its KV cache is planned beside what other processes hold
    (``held_elsewhere(model, max_len)`` bytes: SkyRL's policy workers at their measured peak), asked only then."""
    device = resolve_device(run)
    model = load_base_model(run, model_path, device)
    _, layers = attach_engine_lora(model, engine_slot_count(run.sampler, len(tenants)), run.lora.max_lora_rank)
    rows, max_len = engine_rows(run.sampler, len(tenants), step_rows(run, tenants)), run.max_sequence_length

    def plan_beside_workers() -> int:
        return inference_only_blocks(model, utilization=run.sampler.gpu_memory_utilization,
                                     block_size=run.sampler.prefill_block, rows=rows, max_len=max_len,
                                     kv_dtype=kv_cache_dtype(run.sampler), held_elsewhere=held_elsewhere(model, max_len))

    kv_blocks = engine_kv_blocks(run, model, device, rows, max_len, plan_beside_workers)
    return EngineThread(Engine(model, layers, engine_config(run, device, rows, max_len, kv_blocks)))


def _policy_group(run: RunConfig, plan: SkyRLPlan, model_path: str, pad_token_id: int) -> PPORayActorGroup:
    trainer_cfg = plan.base.trainer
    if plan.strategy == "embedded":
        group = PPORayActorGroup(trainer_cfg, 1, 1, ray.remote(EmbeddedPolicyWorker), pg=None, num_gpus_per_actor=0,
                                 colocate_all=False, sequence_parallel_size=1)
        tenants = {spec.name: {"seed": spec.seed, "lr": spec.lr, "rank": spec.rank, "alpha": spec.alpha}
                   for spec in plan.tenants}
        ray.get(group.async_init_model(model_path, num_training_steps=run.steps * run.optimizer_steps_per_rl_step,
                                       tenants=tenants, max_rank=run.lora.max_lora_rank))
    elif plan.strategy in FSDP_STRATEGIES:
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

        worker = ray.remote(num_gpus=1)(with_fsdp_tenants(with_per_tenant_lora_sync(FSDPPolicyWorkerBase)))
        group = _gpu_group(trainer_cfg, worker)
        # SkyRL's scheduler per tenant, over the optimizer steps the driver's schedule counts
        ray.get(group.async_init_model(model_path, num_training_steps=run.steps * run.optimizer_steps_per_rl_step))
    else:
        from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import MegatronPolicyWorkerBase

        worker_cls = with_megatron_tenant_checkpoints(with_per_tenant_lora_sync(MegatronPolicyWorkerBase))
        worker = ray.remote(num_gpus=1)(worker_cls)
        group = _gpu_group(trainer_cfg, worker)
        # As SkyRL's Tinker backend: a scheduler horizon that never decays (each tenant's LR is set per step).
        ray.get(group.async_init_model(model_path, num_training_steps=int(1e9)))
    ray.get(group.async_run_ray_method("pass_through", "_set_pad_token_id", pad_token_id))
    if plan.strategy != "embedded":
        ray.get(group.async_run_ray_method("pass_through", "prime_optimizer_state"))
        ray.get(group.async_run_ray_method("pass_through", "register_pristine_adapter"))
    if plan.strategy == "megatron":
        seeds = {spec.name: spec.seed for spec in plan.tenants}
        ray.get(group.async_run_ray_method("pass_through", "set_adapter_seeds", seeds))
    elif plan.strategy in FSDP_STRATEGIES:
        specs = {spec.name: {"seed": spec.seed, "lr": spec.lr} for spec in plan.tenants}
        ray.get(group.async_run_ray_method("pass_through", "set_tenant_specs", specs))
    return group


def _training_peaks(plan: SkyRLPlan, group: PPORayActorGroup, max_len: int, vocab_size: int,
                    pad_token_id: int) -> list[dict[str, Any]]:
    """Each GPU-trained worker's report of one training pass at the configured micro-batch, every row ``max_len``
    tokens (``measure_training_peak``); none for the embedded stand-in, which trains on the CPU."""
    if plan.strategy not in FSDP_STRATEGIES:
        return []
    algorithm = plan.base.trainer.algorithm
    batch = peak_pass_batch(plan.base.trainer.micro_train_batch_size_per_gpu, max_len, vocab_size,
                            pad_token_id, with_reference=algorithm.use_kl_loss or algorithm.use_kl_in_reward)
    return ray.get(group.async_run_ray_method("pass_through", "measure_training_peak", batch))


def start_stack_ray(plan: SkyRLPlan) -> Callable[[], None] | None:
    """Starts Ray for ``plan`` (module docstring); returns the join of the registries' sync when it runs in the
    background (the embedded engine with the embedded or FSDP2 workers), else None (SkyRL's ``initialize_ray``
    synced them before returning)."""
    if plan.inference_backend == "embedded" and plan.strategy != "megatron":
        env_vars = ({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if plan.strategy == "embedded"
                    else _skyrl_worker_env(plan))
        start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env_vars})
        # as SkyRL's initialize_ray does, beside the workers' start (they join the registries' actors by name)
        return in_background(sync_skyrl_registries)
    from skyrl.train.utils.utils import initialize_ray

    forget_stale_registry_actors()
    os.environ.setdefault("RAY_worker_niceness", str(RAY_SYSTEM_CONFIG["worker_niceness"]))  # Ray's own env form
    initialize_ray(plan.base)
    return None


def in_background(work: Callable[[], Any]) -> Callable[[], None]:
    """Starts ``work()`` in a daemon thread (one that never holds up the interpreter's exit); returns the join:
    it waits for ``work`` and raises what ``work`` raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - handed to the join
            raised.append(error)

    thread = threading.Thread(target=run, name=f"clora-{getattr(work, '__name__', 'work')}", daemon=True)
    thread.start()

    def join() -> None:
        thread.join()
        if raised:
            raise raised[0]

    return join


def _skyrl_worker_env(plan: SkyRLPlan) -> dict[str, str]:
    """The environment SkyRL's ``initialize_ray`` gives its workers (``prepare_runtime_environment``): for SkyRL's
    GPU workers beside the embedded engine, started without Ray's dashboard, which nothing here reads."""
    from skyrl.train.utils.utils import prepare_runtime_environment

    return prepare_runtime_environment(plan.base)


def _gpu_group(trainer_cfg: Any, worker: Any) -> PPORayActorGroup:
    """SkyRL's actor group of ``worker`` on the placement's GPUs, one GPU per actor."""
    placement = trainer_cfg.placement
    return PPORayActorGroup(trainer_cfg, placement.policy_num_nodes, placement.policy_num_gpus_per_node, worker,
                            pg=None, num_gpus_per_actor=1, colocate_all=False,
                            sequence_parallel_size=trainer_cfg.policy.sequence_parallel_size)


# Run by a watchdog process: while the driver (argv[1]) lives, it keeps the list of the driver's descendant
# processes whose command line names Ray; once the driver has ended, however it ended, it kills those still
# running (the same processes: pid and start time match), so a driver killed with SIGKILL leaves no Ray process.
_WATCHDOG = """
import os, sys, time, psutil
driver = psutil.Process(int(sys.argv[1]))
seen = {}
while True:
    try:
        if driver.status() == psutil.STATUS_ZOMBIE:
            break
        for process in driver.children(recursive=True):
            try:
                if process.pid != os.getpid() and "ray" in " ".join(process.cmdline()):
                    seen[process.pid] = process
            except psutil.Error:
                pass
    except psutil.Error:  # the driver is gone
        break
    time.sleep(0.5)
for process in seen.values():
    try:
        if process.is_running():
            process.kill()
    except psutil.Error:
        pass
"""


def reap_children_with_this_process() -> None:
    """Starts a watchdog that kills the Ray processes this process started (``ray.init``'s head processes, and
    the agents and workers under them) once this process has ended, however it ended (``ray.shutdown`` covers
    the normal exits; SIGKILL is what this is for)."""
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid())], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def build_stack(run: RunConfig, plan: SkyRLPlan, model_path: str) -> SkyRLStack:
    """Starts Ray, the inference servers, the client and views, and the policy worker group."""
    check_buildable(plan)
    hf_logging.disable_progress_bar()
    tokenizer = checked_tokenizer(model_path)
    seconds = _PhaseClock()
    owns_ray = not ray.is_initialized()
    registries = start_stack_ray(plan) if owns_ray else None
    if owns_ray:
        reap_children_with_this_process()
    seconds.lap("ray")
    engine = server = setup = None
    try:
        if plan.inference_backend == "embedded":  # the workers first: the engine's memory plan counts them
            group = _policy_group(run, plan, model_path, tokenizer.pad_token_id)
            if registries is not None:
                registries()
            seconds.lap("policy_workers")
            client, engine, server = _embedded_inference(run, plan, model_path, tokenizer, group, seconds)
            seconds.lap("inference")
        else:  # SkyRL's order: the servers, then the workers
            from skyrl.backends.skyrl_train.inference_servers.setup import build_new_inference_client

            client, setup = build_new_inference_client(plan.base, tokenizer)
            seconds.lap("inference")
            group = _policy_group(run, plan, model_path, tokenizer.pad_token_id)
            seconds.lap("policy_workers")
    except BaseException:
        if server is not None:
            server.stop()
        if engine is not None:
            engine.shutdown()
        if owns_ray:
            ray.shutdown()
        raise
    return SkyRLStack(tokenizer=tokenizer, client=client, views=tenant_views(client, [s.name for s in plan.tenants]),
                      policy_group=group, strategy=plan.strategy,
                      sync_path=plan.base.trainer.policy.model.lora.lora_sync_path, owns_ray=owns_ray,
                      engine=engine, server=server, server_setup=setup, build_seconds=seconds.parts)


class _PhaseClock:
    """Wall seconds of consecutive phases: :meth:`lap` ends the running phase under a name (times added when a name
    recurs) and starts the next; :meth:`aside` takes a nested phase out of the running one."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._started = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._started
        self._started = now

    def aside(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds
        self._started += seconds
