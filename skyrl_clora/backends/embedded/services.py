"""Builds the three shared services of the embedded backend over one frozen base model.

- sampler: :class:`~skyrl_clora.sampler.engine.Engine` run by its
  :class:`~skyrl_clora.sampler.engine_thread.EngineThread` (+ SkyRL client) on the base model with
  ``sampler.adapter_slots`` inference adapter slots (one per tenant when null), filled on demand from the tenants'
  adapters in host memory;
- trainer: :class:`~skyrl_clora.trainer.trainer.Trainer` on a second module tree that shares the base
  model's weight tensors (no copy) and trainable device slots fed by the AdapterStore (several tenants
  per pass in packed mode; the next tenant prefetched into a second slot in swap mode);
- sync: :class:`~skyrl_clora.backends.embedded.sync.AdapterSync` publishing into the sampler.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass

import torch
from transformers.utils import logging as hf_logging

from skyrl_clora.backends.embedded.memory_plan import MemoryPlan, plan_kv_blocks
from skyrl_clora.backends.embedded.sync import AdapterSync
from skyrl_clora.backends.engine_builder import (engine_config, engine_kv_blocks, engine_rows, engine_slot_count,
                                                 kv_cache_dtype)
from skyrl_clora.base_model import checked_tokenizer, load_base_model, resolve_device
from skyrl_clora.config.checks import algorithm_config
from skyrl_clora.config.schema import RunConfig
from skyrl_clora.device.cuda_settings import avoid_cudnn_attention, use_expandable_segments
from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear, attach_multi_lora
from skyrl_clora.sampler.client import EmbeddedInferenceClient
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora, fuse_base_projections
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.scheduler import TrainScheduler
from skyrl_clora.trainer.trainer import OptimizerConfig, Trainer, TrainerSettings

_DEFAULT_BLAS_LIBRARY = torch.backends.cuda.preferred_blas_library()  # what carve_gemm_sms(0) restores


@dataclass
class Services:
    """The shared sampler, trainer and sync, plus what built them."""

    model_path: str
    tokenizer: object
    engine: EngineThread
    client: EmbeddedInferenceClient
    trainer: Trainer
    store: AdapterStore
    sync: AdapterSync
    cold_start_seconds: float

    def train_scheduler(self, run: RunConfig) -> TrainScheduler:
        """The scheduler the tenants of one run share: ``clora.train_mode`` passes, run beside sampling or with the
        engine paused (``clora.overlap_sampling``: true never pauses, false pauses for every pass; null: never on
        the CPU, where the trainer and the engine each keep a core busy; on a GPU, pause while at least
        ``clora.pause_sampling_rows`` rows decode: RESULTS.md, Engine and trainer settings and why), the waiting
        tenants ranked by ``clora.train_priority``."""
        overlap = run.trainer.overlap_sampling
        lockstep, priority = run.trainer.pack_policy == "lockstep", run.trainer.train_priority
        if overlap is None and self.trainer.device.type != "cuda" or overlap is True:
            return TrainScheduler(self.trainer, run.train_mode, lockstep=lockstep, priority=priority)
        pause_rows = 0 if overlap is False else run.trainer.pause_sampling_rows
        return TrainScheduler(self.trainer, run.train_mode, sampler=self.engine, pause_rows=pause_rows, lockstep=lockstep,
                              priority=priority)

    def shutdown(self) -> None:
        self.engine.shutdown()


def release_device_memory() -> None:
    """Frees what dropped :class:`Services` held on the GPU: their engine and trainer keep reference cycles, so their
    tensors (the KV pool most of all) outlive them until a collection, and the next services' memory plan would count
    them as taken. Call it once no reference to them is left."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_services(run: RunConfig, model_path: str, num_tenants: int, rows_per_tenant: int) -> Services:
    """Loads the base model once and builds sampler, trainer and sync around it (the cold start)."""
    started = time.perf_counter()
    hf_logging.disable_progress_bar()
    device = resolve_device(run)
    if device.type == "cuda":
        use_expandable_segments()
        avoid_cudnn_attention()
    tokenizer = checked_tokenizer(model_path)
    sampler_model = load_base_model(run, model_path, device)
    trainer_slots = trainer_slot_count(run, num_tenants)
    sampler_layers, trainer_model, trainer_routing, trainer_layers = share_base_weights(
        sampler_model, engine_slot_count(run.sampler, num_tenants), trainer_slots, run.lora.max_lora_rank)

    store = AdapterStore(trainer_layers, num_slots=trainer_slots)
    algorithm = algorithm_config(run.trainer.algorithm)
    settings = TrainerSettings(
        algorithm, OptimizerConfig(weight_decay=run.trainer.weight_decay, max_grad_norm=run.trainer.max_grad_norm),
        micro_batch_size=run.trainer.micro_train_batch_size_per_gpu,
        max_tokens_per_microbatch=run.trainer.max_tokens_per_microbatch,
        shared_prefix=run.trainer.shared_prompts, mini_batch_prompts=run.trainer.policy_mini_batch_size,
        update_epochs=run.trainer.update_epochs_per_batch,
    )
    trainer = Trainer(trainer_model, trainer_routing, trainer_layers, store, settings)
    max_len = run.max_sequence_length
    rows = engine_rows(run.sampler, num_tenants, rows_per_tenant)
    plans: list[MemoryPlan] = []

    def plan_beside_trainer() -> int:
        tokens_per_micro = run.trainer.max_tokens_per_microbatch
        micro_rows = (max(1, tokens_per_micro // max_len) if tokens_per_micro > 0
                      else run.trainer.micro_train_batch_size_per_gpu)
        pack = trainer_slots if run.train_mode == "packed" else 1
        plans.append(plan_kv_blocks(
            sampler_model, trainer, utilization=run.sampler.gpu_memory_utilization, block_size=run.sampler.prefill_block,
            rows=rows, max_len=max_len, micro_batch_rows=min(micro_rows, pack * rows_per_tenant), pack=pack,
            rank=run.lora.max_lora_rank, kv_dtype=kv_cache_dtype(run.sampler)))
        return plans[0].kv_blocks

    kv_blocks = engine_kv_blocks(run, sampler_model, device, rows, max_len, plan_beside_trainer)
    engine = build_engine_beside_trainer(run, sampler_model, sampler_layers, device, rows, max_len, kv_blocks)
    if plans:
        print(plans[0].engine_line(torch.cuda.memory_allocated(device)), file=sys.stderr, flush=True)
    client = EmbeddedInferenceClient(
        engine, tokenizer, model_name=model_path, seed=run.seed,
        default_sampling={"max_tokens": run.recipe.max_generate_length, "temperature": run.sampler.temperature,
                          "top_p": run.sampler.top_p, "logprobs": 1},
    )
    return Services(model_path, tokenizer, engine, client, trainer, store, AdapterSync(engine),
                    cold_start_seconds=time.perf_counter() - started)


def build_engine_beside_trainer(run: RunConfig, model: torch.nn.Module, layers: dict[str, MultiLoRALinear],
                                device: torch.device, rows: int, max_len: int, kv_blocks: int | None) -> EngineThread:
    """The sampler's engine (:func:`~skyrl_clora.backends.engine_builder.engine_config`) on ``model`` and its engine
    LoRA ``layers`` (``share_base_weights``), of ``rows`` rows of ``max_len`` positions in ``kv_blocks`` KV blocks,
    then, on a GPU, the trainer's eager GEMMs carved (``clora.sm_carveout``, :func:`carve_gemm_sms`): in that
    order, so that the decode graphs, captured while the engine is built, keep every SM. The engine's thread is
    started last."""
    engine = Engine(model, layers, engine_config(run, device, rows, max_len, kv_blocks))
    if device.type == "cuda":
        carve_gemm_sms(run.trainer.sm_carveout)
    return EngineThread(engine)


def carve_gemm_sms(count: int) -> None:
    """Makes the process's eager cuBLAS GEMMs (the trainer's) target all but ``count`` SMs (0: all), process-wide.

    cuBLAS's Hopper GEMMs are persistent kernels that hold every SM until they finish, so each kernel of a decode
    step launched meanwhile waits that long for an SM, however high its stream's priority. Routed through
    cuBLASLt (the path that honours PyTorch's SM carve-out); the engine's decode graphs, captured before this
    runs (:func:`build_engine_beside_trainer`), keep all SMs (its prefill graphs, captured on first use, are carved
    too)."""
    torch.backends.cuda.preferred_blas_library("cublaslt" if count else _DEFAULT_BLAS_LIBRARY)
    torch._C._set_sm_carveout_experimental(count or None)


def trainer_slot_count(run: RunConfig, num_tenants: int) -> int:
    """Trainable device slots: packed mode, ``clora.pack_size`` (0: one per tenant, up to 8); swap mode, two
    when there are two tenants or more (the second receives the next tenant's state while one trains)."""
    if run.train_mode == "packed":
        return min(num_tenants, run.trainer.pack_size or 8)
    return min(num_tenants, 2)


def share_base_weights(
    sampler_model: torch.nn.Module, sampler_slots: int, trainer_slots: int, max_rank: int
) -> tuple[dict[str, MultiLoRALinear], torch.nn.Module, LoRARouting, dict[str, MultiLoRALinear]]:
    """Makes ``sampler_model`` the sampler's and builds the trainer's model on the same base weights, in place.

    1. The sampler's projections are fused (``fuse_base_projections``: q/k/v and gate/up each one weight, with
       room for every slot's LoRA A folded below it).
    2. The trainer's model is a second module tree whose parameters and buffers *are* the sampler's tensors
       (aliases, no copy), taken after step 1 so that it reads the fused weights.
    3. Each tree gets its multi-LoRA layers: ``sampler_slots`` inference slots (the engine's:
       ``attach_engine_lora``, their LoRA A the folded weights' rows) and ``trainer_slots`` trainable slots (the
       AdapterStore's).
    Returns (sampler LoRA layers, trainer model, trainer routing, trainer LoRA layers). The base weights stay
    frozen in both trees: only LoRA slots are written."""
    fuse_base_projections(sampler_model.model.layers, sampler_slots, max_rank)
    trainer_model = _twin_sharing_weights(sampler_model)
    _, sampler_layers = attach_engine_lora(sampler_model, sampler_slots, max_rank)
    trainer_routing, trainer_layers = attach_multi_lora(trainer_model, trainer_slots, max_rank, trainable=True)
    return sampler_layers, trainer_model, trainer_routing, trainer_layers


def _twin_sharing_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A second module tree of the same architecture whose parameters and buffers are ``model``'s tensors."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    twin.load_state_dict(model.state_dict(), assign=True)
    # Non-persistent buffers (rotary inv_freq) are not in the state dict: share them too.
    for name, buffer in model.named_buffers():
        module_path, _, buffer_name = name.rpartition(".")
        twin.get_submodule(module_path).register_buffer(buffer_name, buffer, persistent=False)
    if model.config.tie_word_embeddings:
        twin.tie_weights()
    return twin.train()


