"""Builds the shared part of the ``backend=skyrl`` stack: inference servers + client, tenant views, Ray
and the policy worker group.

- Inference: ``inference_backend=embedded`` serves one :class:`~skyrl_clora.sampler.engine.Engine`
  (one adapter slot per tenant) through :class:`~skyrl_clora.skyrl.server.EmbeddedServer` on 127.0.0.1;
  SkyRL's ``RemoteInferenceClient`` points at it (``proxy_url`` = its one ``server_urls`` entry).
- Training: ``strategy=embedded`` starts Ray small (``num_cpus=2``, no dashboard) unless the caller
  already did, and SkyRL's own ``PPORayActorGroup`` builds one
  :class:`~skyrl_clora.skyrl.worker.EmbeddedPolicyWorker` actor (``num_gpus_per_actor=0``) whose
  ``init_model`` loads the base model inside the actor, given every tenant's seed and learning rate.

vLLM servers and Megatron workers are not built here; a plan that resolves to them is refused with
the fix (:func:`check_buildable`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import torch
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.backends.skyrl_train.workers.worker import PPORayActorGroup
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from skyrl_clora.config import ConfigError, RunConfig
from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.recipes.gsm8k.env import register_gsm8k_env
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.services import resolve_device
from skyrl_clora.skyrl.config_translation import SkyRLPlan
from skyrl_clora.skyrl.server import EmbeddedServer
from skyrl_clora.skyrl.tenant_client import TenantInferenceClient, tenant_views
from skyrl_clora.skyrl.worker import EmbeddedPolicyWorker

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SkyRLStack:
    """What every tenant shares: tokenizer, inference servers and client, the views, the worker group."""

    tokenizer: Any
    client: RemoteInferenceClient
    views: dict[str, TenantInferenceClient]
    policy_group: PPORayActorGroup
    sync_path: str
    engine: Engine
    server: EmbeddedServer
    owns_ray: bool
    _stopped: bool = field(default=False, repr=False)

    def server_version(self, tenant: str) -> int | None:
        """The adapter version the inference server holds for ``tenant``."""
        return self.engine.adapter_version(tenant)

    def step_metrics(self, tenant: str) -> dict[str, float]:
        """The worker's metrics of ``tenant``'s last optimizer step (rank 0's)."""
        return ray.get(self.policy_group.async_run_ray_method("pass_through", "step_metrics", tenant))[0]

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
        return asdict(self.engine.stats)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for info in self.policy_group.actor_infos:
            ray.kill(info.handle)
        self.server.stop()
        self.engine.shutdown()
        if self.owns_ray:
            ray.shutdown()


def check_buildable(plan: SkyRLPlan) -> None:
    """Refuses a plan this module cannot build, with the fix."""
    if plan.inference_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("backend.inference_backend=vllm but vllm is not installed; install vllm or set "
                          "backend.inference_backend=embedded (or auto)")
    if plan.strategy == "megatron" and importlib.util.find_spec("megatron") is None:
        raise ConfigError("backend.strategy=megatron but megatron-core is not installed; install megatron-core or set "
                          "backend.strategy=embedded (or auto)")
    if plan.inference_backend != "embedded" or plan.strategy != "embedded":
        raise ConfigError(
            f"backend=skyrl with inference_backend={plan.inference_backend} strategy={plan.strategy}: the driver builds "
            "the embedded stand-ins only (integration/ holds the vLLM/Megatron tests); set "
            "backend.inference_backend=embedded backend.strategy=embedded"
        )
    base = plan.base.trainer
    if base.placement.colocate_all or base.placement.policy_num_nodes * base.placement.policy_num_gpus_per_node != 1:
        raise ConfigError("backend.strategy=embedded runs one worker: set backend.colocate_all=false "
                          "backend.policy_num_nodes=1 backend.policy_num_gpus_per_node=1")


def build_stack(run: RunConfig, plan: SkyRLPlan, model_path: str) -> SkyRLStack:
    """Starts the inference server, the client and views, Ray and the policy worker group."""
    check_buildable(plan)
    hf_logging.disable_progress_bar()
    register_gsm8k_env()
    names = [spec.name for spec in plan.tenants]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.eos_token_id is None or tokenizer.chat_template is None:
        raise ConfigError(f"model.path={model_path}: tokenizer needs an eos token and a chat template")

    device = resolve_device(run)
    dtype = _DTYPES[run.model_dtype] if run.model_dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    routing, layers = attach_multi_lora(model, len(names), run.lora.max_rank, trainable=False)
    rows_per_tenant = run.recipe.prompts_per_step * max(spec.samples_per_prompt for spec in plan.tenants)
    engine = Engine(model, routing, layers, num_rows=run.sampler.max_rows or len(names) * rows_per_tenant,
                    max_len=run.recipe.max_input_length + run.recipe.max_generate_length,
                    max_prefills_per_step=run.sampler.max_prefills_per_step, block_size=run.sampler.prefill_block,
                    prefix_cache_bytes=run.sampler.prefix_cache_mb << 20)
    server = EmbeddedServer(engine, tokenizer, model_name=model_path, seed=run.seed)
    url = server.start()
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model_path,
                                   uses_lora_weight_sync=True, tokenizer=tokenizer)
    views = tenant_views(client, names)

    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}})
    try:
        trainer_cfg = plan.base.trainer
        group = PPORayActorGroup(trainer_cfg, 1, 1, ray.remote(EmbeddedPolicyWorker), pg=None, num_gpus_per_actor=0,
                                 colocate_all=False, sequence_parallel_size=1)
        tenants = {spec.name: {"seed": spec.seed, "lr": spec.lr, "rank": spec.rank, "alpha": spec.alpha}
                   for spec in plan.tenants}
        ray.get(group.async_init_model(model_path, num_training_steps=run.steps, tenants=tenants,
                                       max_rank=run.lora.max_rank))
        ray.get(group.async_run_ray_method("pass_through", "_set_pad_token_id", tokenizer.pad_token_id))
    except BaseException:
        server.stop()
        engine.shutdown()
        if owns_ray:
            ray.shutdown()
        raise
    return SkyRLStack(tokenizer=tokenizer, client=client, views=views, policy_group=group,
                      sync_path=trainer_cfg.policy.model.lora.lora_sync_path, engine=engine, server=server,
                      owns_ray=owns_ray)
