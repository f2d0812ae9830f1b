"""Packed multi-LoRA training: several adapters' rows in one batch, forward and backward in a few launches.

Host side of the kernels in ``packed_kernels``: the forward is one launch; the backward reads ``dy`` once
(``g = dy @ B`` partials and dB), sums the partials, then reads ``x`` once (dA and dx). One backward yields
the gradients of every adapter's A and B and of ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_clora.kernels.checks import check_frozen_base, check_packed
from skyrl_clora.kernels.launch import cdiv, dot_flags, next_power_of_2, pdl_flags
from skyrl_clora.kernels.lora.meta import ARRIVAL_BLOCKS, LoRAMeta, rank_pad
from skyrl_clora.kernels.lora.packed_kernels import (
    packed_dy_kernel,
    packed_finish_kernel,
    packed_forward_kernel,
    packed_x_kernel,
)
from skyrl_clora.kernels.lora.sgmv import check_meta

# A pipeline stage of the streamed tiles takes at most this much shared memory (tiles are cut down to fit).
_STAGE_BYTES = 48 * 1024
# Elements per program of the finishing kernel: g's sum (one load per dy column tile, all issued at once),
# and the zeros of empty slots' weight gradients.
_G_SUM_BLOCK = 256
_FINISH_BLOCK = 1024


@dataclass(frozen=True)
class PackedConfig:
    """Launch shape of the packed kernels. The defaults were picked on an H200 at the benchmark's shape (bf16,
    rank 16, 4096 rows, 4096 features in and out; kernel times in the docstring of ``PackedLoRAFunction``);
    ``python -m benchmarks.kernels --packed-sweep`` times variants. Tiles are powers of two (row tiles at least
    16: ``tl.dot``'s minimum), cut down where a pipeline stage of the streamed tiles would take more than
    ``_STAGE_BYTES`` of shared memory (fp32, rank 64). Per kernel: ``*_stages`` is the software pipeline's
    depth (``num_stages``), ``*_warps`` the warps per program (None: 4 up to rank 16, else 8), ``*_maxnreg``
    the registers per thread at most (ptxas ``.maxnreg``, to fit more programs per multiprocessor; None: the
    compiler's choice). ``pdl``: launch every kernel as a programmatic dependent launch where the GPU has it
    (Hopper and later), so that each launch overlaps the end of the kernel before.
    """

    # Forward: K tile (x and A), N tile (B and y; at most 8192 / row tile), and row tile: ``fwd_rows``,
    # halved (down to 16) while the batch has fewer than ``fwd_target_programs`` such tiles (about one per
    # multiprocessor; bigger tiles keep more bytes in flight and re-read A[s] and B[s] from L2 less often).
    fwd_block_k: int = 512
    fwd_block_n: int = 256
    fwd_rows: int = 32
    fwd_target_programs: int = 128
    fwd_stages: int = 4
    fwd_warps: int = 4
    fwd_maxnreg: int | None = None
    # Backward, dy kernel (g's partials and dB): column tile of dy and B, row tile.
    dy_block_n: int = 128
    dy_rows: int = 128
    dy_stages: int = 3
    dy_warps: int | None = None
    dy_maxnreg: int | None = None
    # Backward, x kernel (dA and dx): column tile of x, A and dx, row tile.
    x_block_k: int = 256
    x_rows: int = 32
    x_stages: int = 4
    x_warps: int | None = None
    x_maxnreg: int | None = None
    # Programs each backward kernel's chunk size aims for when one slot holds every row (about two per
    # multiprocessor; ``_chunk_rows``). At the benchmark's shape, 256 makes the x kernel's chunks 256 rows
    # (two dA partials per 512-row slot); 128 makes them 512.
    dy_target_programs: int = 256
    x_target_programs: int = 256
    pdl: bool = True


def _launch(warps: int | None, stages: int, maxnreg: int | None, r_pad: int) -> dict[str, int | None]:
    """A kernel's launch options (``warps`` None: 4 up to rank 16, else 8)."""
    num_warps = warps if warps is not None else 4 if r_pad <= 16 else 8
    return {"num_warps": num_warps, "num_stages": stages, "maxnreg": maxnreg}


def _fit(largest: int, unit_bytes: int, budget: int = _STAGE_BYTES) -> int:
    """The largest power of two ``<= largest`` whose ``unit_bytes`` units fit ``budget`` (at least 16:
    ``tl.dot``'s minimum)."""
    n = largest
    while n > 16 and n * unit_bytes > budget:
        n //= 2
    return n


def _forward_rows(num_rows: int, largest: int, target_programs: int) -> int:
    """Row tile of the forward kernel: ``largest``, halved (down to 16) while there would be fewer than
    ``target_programs`` tiles of ``num_rows`` rows."""
    rows = largest
    while rows > 16 and cdiv(num_rows, rows) < target_programs:
        rows //= 2
    return rows


def _chunk_rows(num_rows: int, column_blocks: int, row_tile: int, target_programs: int) -> int:
    """Rows per program of a backward kernel with ``column_blocks`` column tiles: ``row_tile`` times a power
    of two (few compiled variants), the largest at most ``num_rows / cdiv(target_programs, column_blocks)``,
    so that even one slot holding every row is cut into enough chunks to fill the GPU.

    Based on the batch's row count, not on the segments (the host does not know them): a slot shorter than
    a chunk is one chunk, and slots of one chunk need no partial sums.
    """
    tiles = cdiv(num_rows, cdiv(target_programs, column_blocks)) // row_tile
    return row_tile * (1 << (max(tiles, 1).bit_length() - 1))


def _forward(
    y: torch.Tensor, h: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scales: torch.Tensor, meta: LoRAMeta, store: bool, cfg: PackedConfig,
) -> None:  # fmt: skip
    """One launch: ``h[t, :R] = x[t] @ A[s].T`` (float32 ``[T, rank_pad(R)]``, rows with no slot untouched)
    and ``y[t] (+)= scales[s] * h[t] @ B[s].T``; ``store``: ``=``, and zeros on rows with no slot."""
    T, K = x.shape
    S, N, R = lora_b.shape
    r_pad, size = h.shape[1], x.element_size()
    block_m = _forward_rows(T, cfg.fwd_rows, cfg.fwd_target_programs)
    block_k = _fit(cfg.fwd_block_k, (block_m + r_pad) * size)
    block_n = _fit(min(cfg.fwd_block_n, 8192 // block_m), r_pad * size, _STAGE_BYTES // 3)
    k_iters = cdiv(K, block_k)
    packed_forward_kernel[(cdiv(T, block_m) + min(S, T) + int(store),)](
        x, lora_a, lora_b, scales, y, h, meta.sorted_rows, meta.seg_count, S, T, K, N, R, x.stride(0), y.stride(0),
        S_P2=next_power_of_2(S + int(store)), BLOCK_M=block_m, BLOCK_R=r_pad, BLOCK_K=block_k, BLOCK_N=block_n,
        K_ITERS=k_iters, N_ITERS=cdiv(N, block_n), EVEN_K=k_iters * block_k == K, STORE=store, **dot_flags(x),
        **_launch(cfg.fwd_warps, cfg.fwd_stages, cfg.fwd_maxnreg, r_pad), **pdl_flags(x, cfg.pdl),
    )  # fmt: skip


def _backward(
    dy: torch.Tensor, x: torch.Tensor, h: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scales: torch.Tensor, meta: LoRAMeta, dx: torch.Tensor | None, need_a: bool, need_b: bool, store_dx: bool,
    cfg: PackedConfig,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """dA and dB (or None where not needed), and dx written (``store_dx``) or added into, for ``T > 0``.

    Launches: ``packed_dy_kernel`` (gpart, dB), ``packed_finish_kernel`` (g, zeros for empty slots' dA and
    dB) and ``packed_x_kernel`` (dx, dA) when dx or dA is needed. A slot of several chunks has its weight
    gradient blocks summed by the last of its chunks (``LoRAMeta.arrivals``).
    """
    T, K = x.shape
    S, N, R = lora_b.shape
    r_pad, size = h.shape[1], x.element_size()
    need_g = dx is not None or need_a
    n_blocks, k_blocks = cdiv(N, cfg.dy_block_n), cdiv(K, cfg.x_block_k)
    rows_b = _fit(cfg.dy_rows, cfg.dy_block_n * size + r_pad * 4)
    rows_a = _fit(cfg.x_rows, cfg.x_block_k * size + r_pad * 4)
    chunk_b = _chunk_rows(T, n_blocks, rows_b, cfg.dy_target_programs)
    chunk_a = _chunk_rows(T, k_blocks, rows_a, cfg.x_target_programs)
    chunks_b = cdiv(T, chunk_b) + min(S, T)
    gpart = x.new_empty(n_blocks, T, r_pad, dtype=torch.float32) if need_g else h
    db = torch.empty_like(lora_b) if need_b else None
    dbpart = x.new_empty(chunks_b, N * R, dtype=torch.float32) if need_b and T > chunk_b else h
    packed_dy_kernel[(chunks_b, n_blocks)](
        dy, lora_b, h, gpart, db if need_b else lora_b, dbpart, meta.arrivals, scales, meta.sorted_rows, meta.seg_count,
        S, T, N, R, dy.stride(0), S_P2=next_power_of_2(S), CHUNK=chunk_b, BLOCK_M=rows_b, BLOCK_N=cfg.dy_block_n,
        BLOCK_R=r_pad, HAS_G=need_g, HAS_DB=need_b, **dot_flags(x),
        **_launch(cfg.dy_warps, cfg.dy_stages, cfg.dy_maxnreg, r_pad), **pdl_flags(x, cfg.pdl),
    )  # fmt: skip
    g = x.new_empty(T, r_pad, dtype=torch.float32) if need_g else h
    da = torch.empty_like(lora_a) if need_a else None
    dapart = x.new_empty(cdiv(T, chunk_a) + min(S, T), R * K, dtype=torch.float32) if need_a and T > chunk_a else h
    _finish(gpart, g, db, da, meta, need_g, cfg.pdl)
    if need_g:
        store = dx is not None and store_dx
        packed_x_kernel[(cdiv(T, chunk_a) + min(S, T) + int(store), k_blocks, int(need_a) + int(dx is not None))](
            x, lora_a, g, dx if dx is not None else x, da if need_a else lora_a, dapart, meta.arrivals, scales,
            meta.sorted_rows, meta.seg_count, S, T, K, R, x.stride(0), dx.stride(0) if dx is not None else 0,
            S_P2=next_power_of_2(S + int(store)), CHUNK=chunk_a, BLOCK_M=rows_a, BLOCK_K=cfg.x_block_k, BLOCK_R=r_pad,
            HAS_DX=dx is not None, HAS_DA=need_a, STORE=store, **dot_flags(x),
            **_launch(cfg.x_warps, cfg.x_stages, cfg.x_maxnreg, r_pad), **pdl_flags(x, cfg.pdl),
        )  # fmt: skip
    return da, db


def _finish(
    gpart: torch.Tensor, g: torch.Tensor, db: torch.Tensor | None, da: torch.Tensor | None, meta: LoRAMeta,
    sum_g: bool, pdl: bool,
) -> None:  # fmt: skip
    """One ``packed_finish_kernel`` launch: ``g = gpart.sum(0)`` if ``sum_g``, and zeros for the empty slots'
    ``db`` and ``da`` where given. Nothing to do: no launch."""
    S = meta.num_slots
    numel_g = g.numel() if sum_g else 0
    numel_b = db[0].numel() if db is not None else 0
    numel_a = da[0].numel() if da is not None else 0
    programs = [cdiv(numel_g, _G_SUM_BLOCK), S * cdiv(numel_b, _FINISH_BLOCK), S * cdiv(numel_a, _FINISH_BLOCK)]
    if sum(programs) == 0:
        return
    packed_finish_kernel[(sum(programs),)](
        gpart, g, db if db is not None else g, da if da is not None else g, meta.seg_count, numel_g, numel_b, numel_a,
        programs[0], programs[1], G_SPLITS=gpart.shape[0] if sum_g else 0, HAS_G=sum_g, HAS_B=db is not None,
        HAS_A=da is not None, BLOCK_G=_G_SUM_BLOCK, BLOCK=_FINISH_BLOCK, num_warps=4, **pdl_flags(g, pdl),
    )  # fmt: skip


class PackedLoRAFunction(torch.autograd.Function):
    """``y = packed_lora(x, A, B, scales, meta)``: forward in one launch, backward in two or three (plus
    ``dx = dy @ weight`` with a base layer); with a frozen base ``weight`` (and ``bias``), the whole LoRA
    linear layer ``x @ weight.T + bias + packed_lora(x, ...)`` in one node: the LoRA terms are added into
    the base GEMMs' outputs (forward and dx), instead of two more element-wise passes.

    Forward, for ``x: [T, H_in]``, ``A: [P, R, H_in]``, ``B: [P, H_out, R]``, ``s = slot(t)``::

        h[t] = x[t] @ A[s].T                      # [T, R] fp32, saved for backward
        y[t] = scales[s] * h[t] @ B[s].T          # [T, H_out], zero for rows with no slot (written, not added)
        y += x @ weight.T + bias                  # with a base layer

    Backward, for ``dy: [T, H_out]``::

        g[t]  = dy[t] @ B[s]                      # [T, R] fp32 (unscaled)
        dx[t] = scales[s] * g[t] @ A[s]           # zero for rows with no slot
        dx   += dy @ weight                       # with a base layer
        dA[p] = scales[p] * g[rows_p].T @ x[rows_p]   # zero for a slot with no rows
        dB[p] = scales[p] * dy[rows_p].T @ h[rows_p]

    Launches and paths: the forward kernel (``_forward``) handles tiles of 16 or 32 rows of one slot,
    each over all of K and then all of N. Backward (``_backward``): the dy kernel reads ``dy`` once, writing
    ``g``'s per-column-tile partials and dB; the finishing kernel sums ``g`` (and zeroes empty slots'
    gradients); the x kernel reads ``x`` once for dA and writes dx (on separate programs). Both backward
    kernels cut each slot's rows into chunks of ``_chunk_rows`` rows, chosen from ``T`` and the column
    tiles alone so that even one slot holding every row keeps about 256 programs busy (``PackedConfig``'s
    target programs): a slot within one chunk gets its gradient block written directly, a longer one
    through float32 per-chunk partials that the slot's last chunk to finish sums in chunk order
    (deterministic). At the benchmark's shape (8 slots of 512 rows, 4096 features in and out, rank 16) the
    dy kernel's chunks are 512 rows (dB written directly) and the x kernel's 256 (two dA partials per
    slot); at 12,288 rows of one slot and 2048 features, 24 and 48 chunks.

    Bytes at the benchmark's shape (bf16): forward 64 MB (x read, y written) plus h (256 KB); backward 96 MB
    (dy and x read, dx written) plus 8 MB of ``g`` partials written and read back and 4 MB of dA partials.
    Times on an H200, against the memory floor (the five ``[T, H]`` tensors at the copy bandwidth), a second
    finishing launch for dA without PDL and the split-K shrink/expand path: RESULTS.md, Training: packed vs swap.

    ``scales``, ``weight`` and ``bias`` get no gradient. Forward keeps a snapshot of the meta's index
    buffers, so a later ``meta.build`` (the next micro-batch) cannot change what backward reads.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        meta: LoRAMeta,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        config: PackedConfig,
    ) -> torch.Tensor:
        saved = meta.snapshot()
        base = weight is not None
        y = torch.nn.functional.linear(x, weight, bias) if base else x.new_empty(x.shape[0], lora_b.shape[1])
        h = x.new_empty(x.shape[0], rank_pad(lora_a.shape[1]), dtype=torch.float32)
        if x.shape[0] > 0:
            _forward(y, h, x, lora_a, lora_b, scales, saved, not base, config)
        ctx.save_for_backward(x, lora_a, lora_b, scales, weight)
        ctx.h, ctx.meta, ctx.config = h, saved, config
        return y

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, lora_a, lora_b, scales, weight = ctx.saved_tensors
        dy = dy.contiguous()
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        if x.shape[0] == 0:  # (scales, meta, weight, bias and config never get gradients)
            return (
                torch.empty_like(x) if need_x else None,
                torch.zeros_like(lora_a) if need_a else None,
                torch.zeros_like(lora_b) if need_b else None,
                None, None, None, None, None,
            )
        dx = None
        if need_x:
            dx = dy @ weight if weight is not None else torch.empty_like(x)
        da, db = _backward(
            dy, x, ctx.h, lora_a, lora_b, scales, ctx.meta, dx, need_a, need_b, weight is None, ctx.config
        )
        return dx, da, db, None, None, None, None, None


def packed_lora_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    meta: LoRAMeta | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: PackedConfig | None = None,
) -> torch.Tensor:
    """Triton ``packed_lora`` (semantics: ``reference.packed_lora_ref``); returns a new ``[T, H_out]``. With
    a frozen base ``weight: [H_out, H_in]`` (and ``bias: [H_out]``), the whole layer: that plus
    ``x @ weight.T + bias``.

    ``meta``, if given, must have been built from ``token_slots`` (``meta.build(token_slots)``). ``config``:
    the kernels' launch shape (None: ``PackedConfig()``'s defaults).
    """
    check_packed(x, lora_a, lora_b, scales, token_slots)
    if weight is not None:
        if weight.shape != (lora_b.shape[1], x.shape[1]) or weight.dtype != x.dtype or weight.device != x.device:
            raise ValueError(f"the base weight must be [{lora_b.shape[1]}, {x.shape[1]}] {x.dtype} on {x.device}, "
                             f"got {tuple(weight.shape)} {weight.dtype} {weight.device}")
        check_frozen_base(weight, bias)
    config = config or PackedConfig()
    tiles = max(cdiv(lora_b.shape[1], config.dy_block_n), cdiv(x.shape[1], config.x_block_k))
    if tiles > ARRIVAL_BLOCKS:
        raise ValueError(f"the packed backward takes at most {ARRIVAL_BLOCKS} column tiles per slot, this layer "
                         f"needs {tiles}: raise PackedConfig.dy_block_n / x_block_k")
    if meta is None:
        meta = LoRAMeta.for_batch(token_slots, lora_a.shape[0], lora_a.shape[1], 1)
    check_meta(meta, x, lora_a.shape[0])
    return PackedLoRAFunction.apply(x, lora_a, lora_b, scales, meta, weight, bias, config)
