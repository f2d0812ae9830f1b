"""Segmented multi-LoRA ops (SGMV family), host side: shrink ``x @ A.T`` and expand ``h @ B.T`` for a
batch whose rows belong to many adapters, one launch per op for all adapters and all output slices
(kernels in ``sgmv_kernels``), and ``add_lora_triton`` built on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_clora.kernels.checks import check_add_lora
from skyrl_clora.kernels.launch import cdiv, dot_flags, has_pdl, next_power_of_2, pdl_flags
from skyrl_clora.kernels.lora.meta import LoRAMeta, rank_pad
from skyrl_clora.kernels.lora.sgmv_kernels import expand_kernel, shrink_kernel

# Programs a shrink launch aims for (about two waves on an H200's 132 multiprocessors).
_TARGET_PROGRAMS = 264
# Placeholder block boundary for output slices a layer does not have.
_NO_SLICE = 1 << 30


@dataclass(frozen=True)
class SgmvConfig:
    """Launch parameters of one ``add_lora`` call (``default_config`` picks them by shape)."""

    block_m: int = 16
    block_k: int = 128
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    pdl: bool = False


def default_config(num_tokens: int, h_in: int, num_slots: int, num_a_slices: int, rank: int) -> SgmvConfig:
    """Block sizes by shape: small row tiles and split-K for decode, larger tiles for prefill; at decode
sizes the expand is launched with PDL (``sgmv_kernels``), where the GPU has it.

    Split-K doubles until the shrink has about two waves of programs, and is at least what keeps each
    split to 512 (decode) or 2048 (prefill) input features. Prefill tiles at rank 32+ take 8 warps (4 spill
    registers). Picked from a sweep on the H200 (RESULTS.md, Multi-LoRA kernels vs the base GEMM): 128-wide K tiles beat
    64; 16-32 splits beat 8 at K=9728.
    """
    decode = num_tokens <= 256
    block_m = 16 if decode else 64
    block_k = 128
    tiles = cdiv(num_tokens, block_m) + min(num_slots, num_tokens)
    split_k = 1
    while tiles * num_a_slices * split_k < _TARGET_PROGRAMS and split_k * 2 * block_k <= h_in:
        split_k *= 2
    max_split = max(1, h_in // block_k)
    split_k = max(split_k, min(cdiv(h_in, 512 if decode else 2048), max_split))
    num_warps = 8 if not decode and rank_pad(rank) >= 32 else 4
    return SgmvConfig(
        block_m=block_m, block_k=block_k, block_n=128, split_k=split_k, num_warps=num_warps, pdl=decode
    )


def _slice_args(weights: tuple[torch.Tensor, ...], block_n: int) -> dict[str, int]:
    """Per-slice widths, column offsets, first column block and slot stride, padded to three slices."""
    widths = [w.shape[1] for w in weights]
    blocks = [cdiv(n, block_n) for n in widths]
    firsts = [sum(blocks[:i]) for i in range(len(weights))] + [_NO_SLICE] * (3 - len(weights))
    cols = [sum(widths[:i]) for i in range(len(weights))] + [0] * (3 - len(weights))
    widths += [0] * (3 - len(weights))
    strides = [w.stride(0) for w in weights] + [0] * (3 - len(weights))
    return {
        "n0": widths[0], "n1": widths[1], "n2": widths[2], "col1": cols[1], "col2": cols[2],
        "nb1": firsts[1], "nb2": firsts[2], "ss0": strides[0], "ss1": strides[1], "ss2": strides[2],
        "total_blocks": sum(blocks),
    }  # fmt: skip


def check_meta(meta: LoRAMeta, x: torch.Tensor, num_slots: int) -> None:
    """The meta must have been built for this batch (same token count, slot count and device)."""
    if meta.num_slots != num_slots:
        raise ValueError(f"meta has {meta.num_slots} slots, the adapters {num_slots}")
    if meta.num_tokens != x.shape[0]:
        raise ValueError(
            f"meta was built for {meta.num_tokens} tokens, x has {x.shape[0]}: call meta.build(token_slots)"
        )
    if meta.device != x.device:
        raise ValueError(f"meta is on {meta.device}, x on {x.device}")


def sgmv_shrink(
    ws: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    meta: LoRAMeta,
    rank: int,
    config: SgmvConfig,
) -> None:
    """Writes ``ws[split, a, t, :] = x[t, K_split] @ w[a, slot(t), :, K_split].T`` for rows with a slot.

    ``x: [T, K]`` with unit feature stride; ``w: [slices_a, S, rank, K]``, any strides (A as is, or B
    transposed when a backward pass shrinks with it); ``ws: [split_k, slices_a, T, rank_pad(rank)]``
    float32, contiguous: K is cut into ``split_k`` ranges and ``ws.sum(0)`` is the product (every split is
    written, padding columns with zeros). Rows with no slot are left untouched.
    """
    T, K = x.shape
    n_a, S = w.shape[0], w.shape[1]
    n_split = ws.shape[0]
    k_iters = cdiv(cdiv(K, n_split), config.block_k)
    grid = (cdiv(T, config.block_m) + min(S, T), n_split, n_a)
    shrink_kernel[grid](
        x, w, ws, meta.sorted_rows, meta.seg_count,
        S, K, rank, x.stride(0), w.stride(0), w.stride(1), w.stride(2), w.stride(3),
        ws.stride(0), ws.stride(1),
        S_P2=next_power_of_2(S), BLOCK_M=config.block_m, BLOCK_R=rank_pad(rank),
        BLOCK_K=config.block_k, K_ITERS=k_iters, EVEN_K=n_split * k_iters * config.block_k == K,
        **dot_flags(x), PDL=config.pdl and has_pdl(x.device),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def sgmv_expand(
    out: torch.Tensor,
    ws: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scales: torch.Tensor | None,
    meta: LoRAMeta,
    rank: int,
    config: SgmvConfig,
    store: bool = False,
) -> None:
    """In place: ``out[t, col_i:col_i+H_i] += scales[s] * ws[:, a_i, t].sum(0) @ weights[i][s, :, :rank].T``.

    ``weights[i]``: ``[S, H_i, rank]`` views (any strides along H_i and rank; slot strides may differ);
    ``a_i = i`` when ``ws`` has one slice per weight, else 0; ``s = slot(t)``; ``scales=None`` means 1.
    ``out: [T, sum(H_i)]`` with unit column stride. Rows with no slot are left untouched, unless
    ``store``: then ``=`` replaces ``+=`` and rows with no slot are set to zero (all of ``out`` written).
    With ``config.pdl`` the launch may start before the kernel just before it (``sgmv_shrink`` or a sum of
    its partials) has finished, and reads everything but ``ws`` early: that kernel must not write ``out``,
    the weights, ``scales`` or the meta.
    """
    _expand(out, ws, *partials_layout(ws), ws.shape[1] > 1, weights, scales, meta, rank, config, store=store,
            late_out=False)


def partials_layout(ws: torch.Tensor) -> tuple[tuple[int, int, int, int], int]:
    """``sgmv_shrink``'s partials ``ws: [split_k, slices, T, r]`` as the expand kernels address them: (split,
    slice, row, slot) element strides (slot 0: a row holds only its own slot's partials) and the split count."""
    return (ws.stride(0), ws.stride(1), ws.stride(2), 0), ws.shape[0]


def folded_h_layout(h: torch.Tensor) -> tuple[tuple[int, int, int, int], int]:
    """A folded GEMM's extra columns ``h: [T, slices, S, R]`` (every slot's shrink of every row) as the expand
    kernels address them: (split, slice, row, slot) element strides and one split."""
    return (0, h.stride(1), h.stride(0), h.stride(2)), 1


def expand_folded(
    out: torch.Tensor,
    h: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scales: torch.Tensor,
    meta: LoRAMeta,
    rank: int,
    config: SgmvConfig,
) -> None:
    """In place: ``out[t, col_i:col_i+H_i] += scales[s] * h[t, a_i, s, :rank] @ weights[i][s, :, :rank].T``.

    ``h: [T, slices_a, S, rank]`` with unit rank stride holds every slot's shrink of every row, e.g. the
    extra output columns of a GEMM whose weight has each slot's A appended below the base weight
    (``kernels.lora.folded``); ``a_i = i`` when ``h`` has one slice per weight, else 0. Shapes otherwise as
    ``sgmv_expand``. With ``config.pdl`` the launch may start before the kernel just before it has finished,
    which may have written ``out`` and ``h`` (both are read after the wait), but not the weights, ``scales``
    or the meta.
    """
    _expand(out, h, *folded_h_layout(h), h.shape[1] > 1, weights, scales, meta, rank, config, store=False,
            late_out=True)


def _expand(
    out: torch.Tensor,
    ws: torch.Tensor,
    ws_strides: tuple[int, int, int, int],
    split_k: int,
    a_per_slice: bool,
    weights: tuple[torch.Tensor, ...],
    scales: torch.Tensor | None,
    meta: LoRAMeta,
    rank: int,
    config: SgmvConfig,
    store: bool,
    late_out: bool,
) -> None:
    """Launches ``expand_kernel``; ``ws_strides``: (split, slice, row, slot) element strides of ``ws``."""
    S = weights[0].shape[0]
    T = out.shape[0]
    sa = _slice_args(weights, config.block_n)
    grid = (cdiv(T, config.block_m) + min(S, T) + int(store), sa.pop("total_blocks"))
    w = list(weights) + [weights[0]] * (3 - len(weights))
    split_stride, slice_stride, row_stride, slot_stride = ws_strides
    expand_kernel[grid](
        ws, out, w[0], w[1], w[2], scales if scales is not None else ws,
        meta.sorted_rows, meta.seg_count, S, T, rank, **sa,
        stride_w_n=weights[0].stride(1), stride_w_r=weights[0].stride(2), stride_ot=out.stride(0),
        stride_ws_split=split_stride, stride_ws_slice=slice_stride, stride_ws_row=row_stride,
        stride_ws_slot=slot_stride,
        S_P2=next_power_of_2(S + int(store)), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_R=rank_pad(rank), SPLIT_K=split_k, NUM_SLICES=len(weights),
        A_PER_SLICE=a_per_slice, HAS_SCALE=scales is not None, STORE=store, **dot_flags(out),
        **pdl_flags(out, config.pdl), LATE_OUT=late_out,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    meta: LoRAMeta | None = None,
    config: SgmvConfig | None = None,
) -> None:
    """Triton ``add_lora`` (semantics: ``reference.add_lora_ref``); writes ``out`` in place.

    With ``meta`` (built by ``meta.build(token_slots)`` for this batch) nothing is allocated and nothing
    waits for the host, so the call can be captured in a CUDA graph; without it a meta is built here.
    ``config`` overrides ``default_config`` (benchmarks sweep it).
    """
    lora_b = tuple(lora_b)
    check_add_lora(out, x, lora_a, lora_b, scales, token_slots)
    T = x.shape[0]
    if T == 0:
        return
    S, R, K = lora_a.shape[-3:]
    a4 = lora_a if lora_a.dim() == 4 else lora_a.unsqueeze(0)
    if meta is None:
        meta = LoRAMeta.for_batch(token_slots, S, R, a4.shape[0])
    check_meta(meta, x, S)
    cfg = config or default_config(T, K, S, a4.shape[0], R)
    ws = shrink_workspace(meta, T, K, a4.shape[0], R, cfg)
    sgmv_shrink(ws, x, a4, meta, R, cfg)
    sgmv_expand(out, ws, lora_b, scales, meta, R, cfg)


def shrink_workspace(meta: LoRAMeta, T: int, K: int, slices: int, rank: int, config: SgmvConfig) -> torch.Tensor:
    """The view of ``meta.workspace`` that ``sgmv_shrink`` writes for ``T`` rows of ``K`` features:
    ``[split_k, slices, T, rank_pad(rank)]`` float32, with ``config.split_k`` cut down to what the workspace
    holds and to whole K tiles. Raises ValueError if not even one split fits."""
    r_pad = rank_pad(rank)
    per_split = slices * T * r_pad
    split_k = min(config.split_k, meta.workspace.numel() // per_split)
    if split_k < 1:
        raise ValueError(
            f"meta.workspace holds {meta.workspace.numel()} floats, this layer needs {per_split}: "
            "build the LoRAMeta with a larger max_rank or max_slices"
        )
    split_k = cdiv(K, cdiv(cdiv(K, split_k), config.block_k) * config.block_k)
    return meta.workspace[: split_k * per_split].view(split_k, slices, T, r_pad)
