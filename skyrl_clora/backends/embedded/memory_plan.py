"""The GPU memory plan made at start-up: what the model weights, the trainer's peak, the CUDA graph pools and
the engine's workspaces take, and how many KV blocks the rest holds.

``budget = total GPU memory x sampler.gpu_memory_utilization``; from it go the memory already allocated (the
base weights, shared by sampler and trainer, and the AdapterStore's device slots), the trainer's peak above
that for one pass at the configured micro-batch and the longest sequence (measured by running one such pass
on throwaway tenants), and a fixed reserve for the engine's CUDA graph pools and workspaces
(:data:`GRAPH_RESERVE_BYTES`); the KV blocks get what is left. Printed in one line. Off a GPU the engine holds
every row at full length when that fits in :data:`HOST_KV_SHARE` of the host memory available at start-up, else
as many KV blocks as that share holds (:func:`host_kv_blocks`; rows beyond them wait or are preempted).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.trainer import Trainer

GRAPH_RESERVE_BYTES = 3 << 30  # decode and prefill CUDA graph pools, attention and LoRA workspaces, sampling
HOST_STORE_SHARE = 0.8  # the trainer's AdapterStore's share of the host memory available when tenants register (the
# rest: the process, the task data, the model-dtype weight copies a publish holds)
HOST_KV_SHARE = 0.5  # off a GPU, the KV cache's share of the host memory available at start-up (the rest: the
# weights, the trainer's activations and the process)
_GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per part of the plan and the KV blocks it leaves (``kv_blocks`` of ``block_bytes`` each)."""

    total: int
    budget: int
    allocated: int
    training_peak: int
    reserve: int
    block_bytes: int
    kv_blocks: int
    block_size: int
    training_shape: str

    def line(self, rows: int) -> str:
        """The plan in one line."""
        return (f"[setup] GPU memory plan: {self.total / _GIB:.1f} GiB x utilization = {self.budget / _GIB:.1f} GiB: "
                f"weights and adapter slots {self.allocated / _GIB:.1f}, training pass peak {self.training_peak / _GIB:.1f} "
                f"({self.training_shape}), graphs and workspaces {self.reserve / _GIB:.1f} (reserved), KV cache "
                f"{self.kv_blocks * self.block_bytes / _GIB:.1f} = {self.kv_blocks:,} blocks x {self.block_size} tokens "
                f"({self.kv_blocks * self.block_size:,} positions for {rows} rows)")

    def engine_line(self, allocated: int) -> str:
        """What the engine built on this plan took beside its KV blocks (its buffers, workspaces and decode CUDA
        graphs; prefill graphs come on first use) against the reserve, given ``allocated`` bytes after it."""
        taken = allocated - self.allocated - self.kv_blocks * self.block_bytes
        verdict = "within" if taken <= self.reserve else "OVER"
        return (f"[setup] engine built: buffers, workspaces and decode graphs {taken / _GIB:.2f} GiB, {verdict} the "
                f"{self.reserve / _GIB:.1f} GiB reserved")


def kv_block_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block (K and V of ``block_size`` positions in every layer) of a model with ``config``, in the
    cache's ``dtype`` (an fp8 cache's blocks take half a bf16 one's)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * block_size * head_dim * element


def measure_training_peak(trainer: Trainer, tenants: int, rows: int, seq_len: int, rank: int) -> int:
    """Bytes above the current allocation one training pass takes: ``tenants`` throwaway tenants (packed when
    more than one) of ``rows`` rows in all, each a ``seq_len``-token sequence (half prompt, half response).
    The tenants are removed afterwards and the allocator's cache emptied."""
    device = trainer.device
    vocab = trainer.head.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    names = [f"memory-plan-{index}" for index in range(tenants)]
    per_tenant = -(-rows // tenants)
    prompt, response = seq_len // 2, seq_len - seq_len // 2
    batch = TrainBatch(
        prompt_ids=[torch.randint(vocab, (prompt,), generator=generator).tolist() for _ in range(per_tenant)],
        response_ids=[torch.randint(vocab, (response,), generator=generator).tolist() for _ in range(per_tenant)],
        loss_masks=[[1] * response for _ in range(per_tenant)],
        rewards=[float(index % 2) for index in range(per_tenant)],
        group_ids=[str(index // 2) for index in range(per_tenant)],
        rollout_logprobs=None,
    )
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    weights = init_adapter(trainer.layers, rank, 2.0 * rank, generator)
    try:
        for name in names:
            trainer.store.register(name, weights, LRSchedule(base_lr=1e-6), seed=0)
        if tenants > 1:
            trainer.train_packed([(name, batch) for name in names])
        else:
            trainer.train_step(names[0], batch)
        torch.cuda.synchronize(device)
    finally:
        for name in names:
            if name in trainer.store.tenants:
                trainer.store.remove(name)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def plan_kv_blocks(model: torch.nn.Module, trainer: Trainer, *, utilization: float, block_size: int, rows: int,
                   max_len: int, micro_batch_rows: int, pack: int, rank: int,
                   kv_dtype: torch.dtype | None = None) -> MemoryPlan:
    """The plan for ``model`` (the sampler's, on a GPU) beside ``trainer`` (see module docstring), in KV blocks of
    ``kv_dtype`` (None: the model's); raises ConfigError when the KV blocks left cannot hold one row of ``max_len``
    positions."""
    peak = measure_training_peak(trainer, pack, micro_batch_rows, max_len, rank)
    return _plan(model, utilization, block_size, rows, max_len, kv_dtype, peak,
                 f"measured: {pack} tenant(s), {micro_batch_rows} rows x {max_len} tokens",
                 "raise sampler.gpu_memory_utilization, lower trainer.micro_train_batch_size_per_gpu (or "
                 "trainer.max_tokens_per_microbatch) or shorten the recipe's lengths")


def inference_only_blocks(model: torch.nn.Module, *, utilization: float, block_size: int, rows: int,
                          max_len: int, kv_dtype: torch.dtype | None = None, held_elsewhere: int = 0) -> int:
    """KV blocks (of ``kv_dtype``, None: the model's) for an engine whose trainer runs in other processes
    (backend=skyrl's embedded server): the plan with ``held_elsewhere`` bytes (what those processes take of this GPU
    at their training peak: :func:`skyrl_clora.backends.skyrl.shared_gpu.held_by_other_processes`) in place of a training
    peak."""
    shape = ("SkyRL's policy workers on this GPU at their measured peak" if held_elsewhere
             else "none here: the trainer runs in other processes")
    return _plan(model, utilization, block_size, rows, max_len, kv_dtype, held_elsewhere, shape,
                 "raise sampler.gpu_memory_utilization, set sampler.kv_blocks, lower "
                 "trainer.micro_train_batch_size_per_gpu or shorten the recipe's lengths").kv_blocks


def host_kv_blocks(config, *, dtype: torch.dtype, block_size: int, rows: int, max_len: int,
                   available: int) -> int | None:
    """Off a GPU: None (every one of ``rows`` rows at its full ``max_len`` positions) when that fits in
    :data:`HOST_KV_SHARE` of ``available`` bytes of host memory, else the KV blocks of ``block_size`` positions that
    share holds (printed in one line). ConfigError when it cannot hold one sequence of ``max_len`` positions."""
    block_bytes = kv_block_bytes(config, block_size, dtype)
    budget = int(available * HOST_KV_SHARE)
    per_row = -(-max_len // block_size)
    if rows * per_row * block_bytes <= budget:
        return None
    blocks = budget // block_bytes
    if blocks < per_row:
        raise ConfigError(f"{HOST_KV_SHARE:.0%} of the {available / _GIB:.1f} GiB of host memory available holds {blocks} KV "
                          f"blocks, fewer than the {per_row} one sequence of {max_len} tokens needs; shorten the recipe's "
                          "lengths or free memory")
    print(f"[setup] host memory plan: {rows} rows x {max_len} tokens need {rows * per_row * block_bytes / _GIB:.1f} GiB "
          f"of KV cache, more than {HOST_KV_SHARE:.0%} of the {available / _GIB:.1f} GiB available: {blocks:,} blocks x "
          f"{block_size} tokens ({blocks * block_size:,} positions; rows beyond them wait)", file=sys.stderr, flush=True)
    return blocks


def check_tenant_host_memory(store: AdapterStore, ranks: list[int], available: int) -> None:
    """Refuses (ConfigError: one line with the most tenants that fit and the fixes) registering tenants of LoRA
    ``ranks`` whose trainer state (:meth:`AdapterStore.host_bytes` each) does not fit in :data:`HOST_STORE_SHARE` of
    ``available`` bytes of host memory (what is available now: tenants already registered hold theirs)."""
    need = sum(store.host_bytes(rank) for rank in ranks)
    budget = int(available * HOST_STORE_SHARE)
    if need <= budget:
        return
    largest = store.host_bytes(max(ranks))
    tenants = "a tenant needs" if len(ranks) == 1 else f"{len(ranks)} tenants need"
    raise ConfigError(f"{tenants} {need / _GIB:.1f} GiB of host memory for trainer state (LoRA weights, fp32 masters, "
                      f"Adam moments and gradients: {largest / (1 << 20):.0f} MiB a tenant at rank {max(ranks)}), more than "
                      f"{HOST_STORE_SHARE:.0%} of the {available / _GIB:.1f} GiB available: run at most {budget // largest} "
                      "more tenants, lower their LoRA rank or free host memory")


def available_host_memory() -> int:
    """Bytes of host memory available now (Linux: the kernel's MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _plan(model: torch.nn.Module, utilization: float, block_size: int, rows: int, max_len: int,
          kv_dtype: torch.dtype | None, training_peak: int, training_shape: str, fix: str) -> MemoryPlan:
    """``utilization`` of the GPU's memory less what is allocated, ``training_peak`` and
    :data:`GRAPH_RESERVE_BYTES`, in KV blocks of ``block_size`` positions; printed in one line. ConfigError
    (naming ``fix``) when that cannot hold one row of ``max_len`` positions."""
    param = next(model.parameters())
    _, total = torch.cuda.mem_get_info(param.device)
    budget = int(total * utilization)
    allocated = torch.cuda.memory_allocated(param.device)
    block_bytes = kv_block_bytes(model.config, block_size, kv_dtype or param.dtype)
    blocks = (budget - allocated - training_peak - GRAPH_RESERVE_BYTES) // block_bytes
    plan = MemoryPlan(total, budget, allocated, training_peak, GRAPH_RESERVE_BYTES, block_bytes, max(0, blocks),
                      block_size, training_shape)
    needed = -(-max_len // block_size)
    if blocks < needed:
        raise ConfigError(f"the GPU memory plan leaves {max(0, blocks)} KV blocks, fewer than the {needed} one sequence of "
                          f"{max_len} tokens needs ({plan.line(rows)}); {fix}")
    print(plan.line(rows), file=sys.stderr, flush=True)
    return plan
