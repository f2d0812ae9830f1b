"""The sampler's engine as both backends build it: every ``sampler.*`` key is read here, once, so that it means the
same on ``backend=embedded`` (the engine beside the in-process trainer, :mod:`skyrl_clora.backends.embedded.services`)
and on ``backend=skyrl`` with the embedded server (the engine beside SkyRL's policy workers,
:mod:`skyrl_clora.backends.skyrl.stack`).

What differs between the two is only what shares the GPU with the engine, which the caller's memory plan counts
(:func:`engine_kv_blocks`' ``gpu_plan``): the trainer's measured peak in this process, or what the policy worker
processes hold at theirs. The base model (its dtype and device) and the tokenizer check are
:mod:`skyrl_clora.base_model`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from skyrl_clora.backends.embedded.memory_plan import available_host_memory, host_kv_blocks
from skyrl_clora.config.schema import RunConfig, SamplerConfig
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.tenants import TenantSpec

GPU_PREFILL_WAIT_STEPS = 8  # sampler.prefill_wait_steps=null on a GPU (RESULTS.md, Real rollouts)
ROW_QUANTUM = 16  # the engine's rows are a whole number of decode row quanta


def engine_rows(sampler: SamplerConfig, num_tenants: int, rows_per_tenant: int) -> int:
    """The engine's cache rows: ``sampler.max_rows`` (0: every tenant's whole step batch, ``num_tenants`` x
    ``rows_per_tenant``), rounded up to a multiple of :data:`ROW_QUANTUM`."""
    rows = sampler.max_rows or num_tenants * rows_per_tenant
    return -(-rows // ROW_QUANTUM) * ROW_QUANTUM


def engine_slot_count(sampler: SamplerConfig, num_tenants: int) -> int:
    """The engine's device adapter slots for ``num_tenants`` tenants: ``sampler.adapter_slots`` (null: one per
    tenant), at most one per tenant; the folded projections carry each slot's LoRA A as extra GEMM columns."""
    return min(sampler.adapter_slots or num_tenants, num_tenants)


def kv_cache_dtype(sampler: SamplerConfig) -> torch.dtype | None:
    """The engine's KV cache dtype for ``sampler.kv_cache_dtype``: None (``auto``: the model's) or
    ``torch.float8_e4m3fn`` (``fp8``, ``fp8_e4m3``; scale 1.0)."""
    return None if sampler.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def prefill_wait_steps(sampler: SamplerConfig, device: torch.device) -> int:
    """``sampler.prefill_wait_steps``, or where it is null :data:`GPU_PREFILL_WAIT_STEPS` on a GPU (a prefill
    pass costs about the same for one prompt or many there) and 0 on the CPU (where its cost grows with its tokens)."""
    if sampler.prefill_wait_steps is not None:
        return sampler.prefill_wait_steps
    return GPU_PREFILL_WAIT_STEPS if device.type == "cuda" else 0


def engine_kv_blocks(run: RunConfig, model: torch.nn.Module, device: torch.device, rows: int, max_len: int,
                     gpu_plan: Callable[[], int]) -> int | None:
    """The engine's KV blocks: ``sampler.kv_blocks``; else, on a GPU, ``gpu_plan()`` (the caller's memory plan at
    ``sampler.gpu_memory_utilization``, which knows what shares the GPU); else, off a GPU, None (every row at full
    length) when that fits the host's share, or the blocks the host holds (``memory_plan.host_kv_blocks``)."""
    if run.sampler.kv_blocks:
        return run.sampler.kv_blocks
    if device.type == "cuda":
        return gpu_plan()
    dtype = kv_cache_dtype(run.sampler) or next(model.parameters()).dtype
    return host_kv_blocks(model.config, dtype=dtype, block_size=run.sampler.prefill_block, rows=rows, max_len=max_len,
                          available=available_host_memory())


def engine_config(run: RunConfig, device: torch.device, rows: int, max_len: int, kv_blocks: int | None) -> EngineConfig:
    """The :class:`EngineConfig` of ``run``'s ``sampler.*`` keys for an engine on ``device`` of ``rows`` rows
    (:func:`engine_rows`) of ``max_len`` positions in ``kv_blocks`` blocks (:func:`engine_kv_blocks`). On a GPU,
    decode K/V reuse (unless ``sampler.reuse_decode_kv`` says otherwise) and shared prefix reads are on."""
    sampler = run.sampler
    return EngineConfig(
        num_rows=rows, max_len=max_len, max_prefills_per_step=sampler.max_prefills_per_step,
        block_size=sampler.prefill_block, num_blocks=kv_blocks, cache_prefixes=sampler.enable_prefix_caching,
        cuda_graphs=sampler.cuda_graphs,
        reuse_decode_kv=device.type == "cuda" if sampler.reuse_decode_kv is None else sampler.reuse_decode_kv,
        share_prefix_reads=device.type == "cuda", stream_priority=sampler.stream_priority,
        prefill_wait_steps=prefill_wait_steps(sampler, device), kv_dtype=kv_cache_dtype(sampler),
        admission=sampler.admission, reserve_kv=sampler.reserve_kv)


def step_rows(run: RunConfig, tenants: Sequence[TenantSpec]) -> int:
    """Rows one tenant's step batch takes: the recipe's prompts per step x the most samples per prompt any of
    ``tenants`` asks for."""
    return run.recipe.prompts_per_step * max(spec.samples_per_prompt for spec in tenants)
