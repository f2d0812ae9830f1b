"""Per-step segment metadata for the multi-LoRA Triton kernels, built on the device into preallocated buffers.

A batch's rows belong to adapter slots in any order. The segmented kernels want the rows grouped by slot:
``LoRAMeta.build`` writes, with one Triton launch and no host synchronisation, the row permutation and
each slot's segment into buffers allocated once. A decode step that calls ``build`` and then the layers
can therefore be captured in a CUDA graph and replayed with new ``token_slots`` copied into its input.
"""

from __future__ import annotations

import copy

import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.launch import next_power_of_2

# Tokens handled per loop iteration of the build kernel (it compares a chunk with itself: CHUNK**2 work).
_BUILD_CHUNK = 128
# Shrink partial sums a workspace holds per (slice, token, rank) at the meta's largest batch.
_WORKSPACE_SPLITS = 4
# Arrival counters per slot: column blocks of a weight gradient summed by its last chunk (``packed_kernels``).
ARRIVAL_BLOCKS = 256


def rank_pad(rank: int) -> int:
    """The rank the kernels compute with: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, next_power_of_2(rank))


@triton.jit
def inclusive_cumsum(v, idx):
    """``cumsum(v)`` over a short vector as a triangular sum (``idx = arange(len(v))``): one reduction,
    where ``tl.cumsum`` costs a Python call per element in the CPU interpreter."""
    return tl.sum(tl.where(idx[None, :] <= idx[:, None], v[None, :], 0), axis=1)


@triton.jit
def _build_meta_kernel(
    slots_ptr,
    sorted_ptr,
    start_ptr,
    count_ptr,
    T,
    S,
    S_P2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: a stable counting sort of the rows by slot. Rows whose slot is outside [0, S) go to a
    last bucket (index S, the "null segment") after all the slots' rows; ``S_P2 > S``."""
    sid = tl.arange(0, S_P2)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([S_P2], dtype=tl.int32)
    c0 = 0
    while c0 < T:  # a while loop: the CPU interpreter cannot run a for loop to a runtime bound
        t = c0 + lane
        s = tl.load(slots_ptr + t, mask=t < T, other=-1).to(tl.int32)
        bucket = tl.where(t < T, tl.where((s >= 0) & (s < S), s, S), -1)
        counts += tl.sum((bucket[:, None] == sid[None, :]).to(tl.int32), axis=0)
        c0 += CHUNK
    starts = inclusive_cumsum(counts, sid) - counts
    tl.store(count_ptr + sid, counts, mask=sid < S)
    tl.store(start_ptr + sid, starts, mask=sid < S)
    running = starts
    c0 = 0
    while c0 < T:
        t = c0 + lane
        s = tl.load(slots_ptr + t, mask=t < T, other=-1).to(tl.int32)
        bucket = tl.where(t < T, tl.where((s >= 0) & (s < S), s, S), -1)
        onehot = (bucket[:, None] == sid[None, :]).to(tl.int32)
        base = tl.sum(onehot * running[None, :], axis=1)
        earlier = (bucket[:, None] == bucket[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, t, mask=bucket >= 0)
        running += tl.sum(onehot, axis=0)
        c0 += CHUNK


class LoRAMeta:
    """Rows of one batch grouped by adapter slot, in buffers allocated once and refilled each step.

    Usage::

        meta = LoRAMeta(max_tokens=8192, num_slots=8, device="cuda")   # once
        meta.build(token_slots)        # each step: one launch, no allocation, no host sync
        add_lora(out, x, lora_a, lora_b, scales, token_slots, meta=meta)   # every layer of the step

    ``build`` semantics, torch pseudo-code for ``token_slots: [T]`` (int32/int64, ``T <= max_tokens``)::

        valid = (token_slots >= 0) & (token_slots < S)         # S = num_slots; other rows: no adapter
        bucket = where(valid, token_slots, S)
        seg_count[:] = bincount(token_slots[valid], minlength=S)                    # [S] int32
        seg_start[:] = cumsum(seg_count) - seg_count                                # [S] int32
        sorted_rows[:T] = argsort(bucket, stable=True)                              # int32

    so ``sorted_rows[seg_start[s] : seg_start[s] + seg_count[s]]`` are the rows of slot ``s`` in
    ascending order, and ``sorted_rows[valid.sum() : T]`` the rows with no adapter (the "null segment",
    which kernels that write rather than add use to zero those rows). Entries past ``T`` are stale.

    ``workspace`` is a float32 scratch buffer for the shrink kernel's partial sums (``[split, slices, T,
    rank_pad(max_rank)]``), sized for ``max_slices`` slices and ``max_rank`` at ``max_tokens`` rows.
    ``arrivals`` (``[num_slots * ARRIVAL_BLOCKS]`` int32) are the packed backward kernels' counters, zero
    between launches; a snapshot shares them, so the packed backward passes of one meta must run one at a
    time (on one stream, as autograd runs them).
    """

    def __init__(
        self,
        max_tokens: int,
        num_slots: int,
        device: torch.device | str,
        max_rank: int = 64,
        max_slices: int = 3,
    ) -> None:
        if max_tokens < 1 or num_slots < 1 or max_rank < 1 or max_slices < 1:
            raise ValueError(
                f"LoRAMeta sizes must be positive, got max_tokens={max_tokens}, num_slots={num_slots}, "
                f"max_rank={max_rank}, max_slices={max_slices}"
            )
        self.max_tokens = max_tokens
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.sorted_rows = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.device = self.sorted_rows.device  # normalised: "cuda" becomes "cuda:0"
        self.seg_start = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        self.seg_count = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        ws_numel = _WORKSPACE_SPLITS * max_slices * max_tokens * rank_pad(max_rank)
        self.workspace = torch.empty(ws_numel, dtype=torch.float32, device=self.device)
        self.arrivals = torch.zeros(num_slots * ARRIVAL_BLOCKS, dtype=torch.int32, device=self.device)
        self.num_tokens = 0
        self._snapshot: LoRAMeta | None = None

    def build(self, token_slots: torch.Tensor) -> None:
        """Fills the buffers for ``token_slots: [T]`` (one launch; capturable in a CUDA graph)."""
        if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"token_slots must be a 1-D int32/int64 tensor, got shape {tuple(token_slots.shape)} "
                f"dtype {token_slots.dtype}"
            )
        if token_slots.device != self.device:
            raise ValueError(f"token_slots is on {token_slots.device}, the meta on {self.device}")
        if not token_slots.is_contiguous():
            raise ValueError("token_slots must be contiguous")
        T = token_slots.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"{T} tokens exceed this LoRAMeta's max_tokens={self.max_tokens}")
        self.num_tokens = T
        self._snapshot = None
        _build_meta_kernel[(1,)](
            token_slots,
            self.sorted_rows,
            self.seg_start,
            self.seg_count,
            T,
            self.num_slots,
            S_P2=next_power_of_2(self.num_slots + 1),
            CHUNK=_BUILD_CHUNK,
            num_warps=4,
        )

    def snapshot(self) -> "LoRAMeta":
        """A copy of the built index buffers, without workspace (what a backward pass reads later).

        Made once per ``build``: every layer of a training forward shares it.
        """
        if self._snapshot is not None:
            return self._snapshot
        snap = copy.copy(self)
        snap.sorted_rows = self.sorted_rows[: max(1, self.num_tokens)].clone()
        snap.seg_start = self.seg_start.clone()
        snap.seg_count = self.seg_count.clone()
        snap.workspace = self.workspace[:0]
        self._snapshot = snap
        return snap

    @classmethod
    def for_batch(
        cls, token_slots: torch.Tensor, num_slots: int, max_rank: int, max_slices: int
    ) -> "LoRAMeta":
        """A meta sized for exactly this batch and built from it (allocates: for calls without a meta)."""
        meta = cls(max(1, token_slots.shape[0]), num_slots, token_slots.device, max_rank, max_slices)
        meta.build(token_slots)
        return meta
