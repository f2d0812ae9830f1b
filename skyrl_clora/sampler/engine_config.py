"""The sampling engine's settings, one frozen value: :class:`EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_clora.sampler.fair_share import ADMISSIONS

# The engine stream's CUDA priority by name (lower is higher; the trainer's default streams are at 0).
STREAM_PRIORITIES = {"high": -1, "normal": 0}


@dataclass(frozen=True)
class EngineConfig:
    """What an :class:`~skyrl_clora.sampler.engine.Engine` is built with (besides its model and LoRA layers).

    ``num_rows``: cache rows, i.e. requests running at once (rounded up to whole decode row quanta).
    ``max_len``: positions per row, prompt and completion together (rounded up to whole blocks).

    ``max_prefills_per_step``: the most requests one prefill pass takes (its token budget is that many blocks).
    ``block_size``: positions per KV block (and the prefill pass's block). ``num_blocks``: KV blocks in the pool
    (None: enough for every row at ``max_len`` twice over: a CPU default; a GPU's comes from the memory plan).

    ``cache_prefixes``: prompt blocks stay keyed for later prompts with the same prefix (and histories may be
    kept). ``cuda_graphs``: decode steps replay CUDA graphs captured when the engine is built (CUDA only).

    ``reuse_decode_kv``: a finished request's blocks (its prompt and sampled tokens) stay in the pool as a
    history, which the next request whose prompt extends it adopts instead of recomputing (needs
    ``cache_prefixes``). Decode steps compute K/V with other kernels than prefill, so on the CPU this would make
    a request's bits depend on whether its history was still cached (i.e. on other tenants' traffic): off by
    default, on for GPU runs (``sampler.reuse_decode_kv``).

    ``share_prefix_reads``: decode attention reads the positions of the keyed blocks that rows share once for
    up to eight such rows (:class:`~skyrl_clora.sampler.shared_rows.SharedPrefixRows`), instead of once per row:
    the same answer up to rounding (bit for bit on the CPU, whose reference reads the shared blocks per row). On
    for GPU runs (the services), where decode attention is bound by reading K/V.

    ``stream_priority``: a key of :data:`STREAM_PRIORITIES`: ``"high"`` (the engine's blocks are scheduled ahead
    of waiting training blocks) or ``"normal"`` (the engine's stream and the trainer's default stream share the
    GPU as equals).

    ``prefill_wait_steps``: while rows decode, a waiting request is prefilled once ``max_prefills_per_step``
    requests wait or it has waited this many decode steps (:class:`~skyrl_clora.sampler.scheduler.Scheduler`);
    0 prefills at every round.

    ``kv_dtype``: the KV cache's dtype (None: the model's; ``torch.float8_e4m3fn``: half the bytes per block and
    per decode read, scale 1.0, see :class:`~skyrl_clora.sampler.model_runner.ModelRunner`).

    ``admission``: the order waiting requests are admitted in: ``"fifo"`` (arrival order over all tenants) or
    ``"fair"`` (the tenant that received the least service first: virtual-token counters,
    :mod:`~skyrl_clora.sampler.fair_share`).

    ``reserve_kv``: a request is admitted only when the KV blocks it needs to finish (prompt and ``max_tokens``) are
    available beside those the running requests still need, so no running request is preempted for want of blocks;
    False admits while the prompt fits and preempts when the pool runs short
    (:class:`~skyrl_clora.sampler.scheduler.Scheduler`).

    Raises ValueError on construction for an unknown ``stream_priority`` or ``admission`` or a non-positive size.
    """

    num_rows: int
    max_len: int
    max_prefills_per_step: int = 8
    block_size: int = 16
    num_blocks: int | None = None
    cache_prefixes: bool = True
    cuda_graphs: bool = True
    reuse_decode_kv: bool = False
    share_prefix_reads: bool = False
    stream_priority: str = "high"
    prefill_wait_steps: int = 0
    kv_dtype: torch.dtype | None = None
    admission: str = "fifo"
    reserve_kv: bool = True

    def __post_init__(self) -> None:
        if self.stream_priority not in STREAM_PRIORITIES:
            raise ValueError(f"stream_priority={self.stream_priority!r} is unknown; use one of {sorted(STREAM_PRIORITIES)}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission={self.admission!r} is unknown; use one of {', '.join(ADMISSIONS)}")
        for name in ("num_rows", "max_len", "max_prefills_per_step", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be at least 1, got {getattr(self, name)}")
