"""Argument checks of the Triton host wrappers: dtype, shape, stride and device, raised as ValueError.

The kernels themselves validate nothing; every wrapper calls one of these before launching.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_CACHE_DTYPE = torch.float8_e4m3fn
"""The one dtype a K/V cache may have besides its query's: float8 e4m3 with a scale of 1.0 (vLLM's
``kv_cache_dtype=fp8`` without calibrated scales); the kernels convert loaded K/V to the query's dtype."""
MAX_SLICES = 3
PREFILL_METADATA = ("job_rows", "job_starts", "q_offsets", "q_lens")  # prefill_attention's per-job tensors


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along features, got strides {t.stride()}")


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be one of {FLOAT_DTYPES}, got {x.dtype}")
    _check_rows("x", x, x.dtype)


def _check_slots(token_slots: torch.Tensor, num_tokens: int) -> None:
    if token_slots.dim() != 1 or token_slots.shape[0] != num_tokens:
        raise ValueError(f"token_slots must be [{num_tokens}], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    if not token_slots.is_contiguous():
        raise ValueError("token_slots must be contiguous")


def _check_scales(scales: torch.Tensor, num_slots: int) -> None:
    if scales.dim() != 1 or scales.shape[0] != num_slots:
        raise ValueError(f"scales must be [{num_slots}], got shape {tuple(scales.shape)}")
    if scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous float32, got {scales.dtype}")


def _check_same_device(tensors: Sequence[torch.Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def check_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """Checks the arguments of ``add_lora`` for the Triton path (see ``reference.add_lora_ref``)."""
    _check_input(x)
    _check_rows("out", out, x.dtype)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, x has {x.shape[0]}")
    if not isinstance(lora_b, (tuple, list)) or not 1 <= len(lora_b) <= MAX_SLICES:
        raise ValueError(f"lora_b must be a tuple of 1..{MAX_SLICES} tensors [S, H_out_i, R]")
    if lora_a.dim() == 4:
        if lora_a.shape[0] != len(lora_b):
            raise ValueError(f"lora_a has {lora_a.shape[0]} slices, lora_b has {len(lora_b)}")
        num_slots, rank, h_in = lora_a.shape[1:]
    elif lora_a.dim() == 3:
        num_slots, rank, h_in = lora_a.shape
    else:
        raise ValueError(f"lora_a must be [S, R, H_in] or [slices, S, R, H_in], got {tuple(lora_a.shape)}")
    if lora_a.dtype != x.dtype or not lora_a.is_contiguous():
        raise ValueError(f"lora_a must be contiguous {x.dtype}, got {lora_a.dtype}")
    if h_in != x.shape[1]:
        raise ValueError(f"lora_a takes {h_in} input features, x has {x.shape[1]}")
    width = 0
    for i, b in enumerate(lora_b):
        if b.dim() != 3 or b.shape[0] != num_slots or b.shape[2] != rank:
            raise ValueError(f"lora_b[{i}] must be [{num_slots}, H_out, {rank}], got {tuple(b.shape)}")
        if b.dtype != x.dtype or not b.is_contiguous():
            raise ValueError(f"lora_b[{i}] must be contiguous {x.dtype}, got {b.dtype}")
        width += b.shape[1]
    if width != out.shape[1]:
        raise ValueError(f"lora_b slices are {width} wide in total, out has {out.shape[1]} columns")
    _check_scales(scales, num_slots)
    _check_slots(token_slots, x.shape[0])
    _check_same_device([out, x, lora_a, *lora_b, scales, token_slots])


def check_packed(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """Checks the arguments of ``packed_lora`` for the Triton path (see ``reference.packed_lora_ref``)."""
    _check_input(x)
    if lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a must be [P, R, {x.shape[1]}], got {tuple(lora_a.shape)}")
    num_slots, rank, _ = lora_a.shape
    if lora_b.dim() != 3 or lora_b.shape[0] != num_slots or lora_b.shape[2] != rank:
        raise ValueError(f"lora_b must be [{num_slots}, H_out, {rank}], got {tuple(lora_b.shape)}")
    for name, w in (("lora_a", lora_a), ("lora_b", lora_b)):
        if w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous {x.dtype}, got {w.dtype}")
    _check_scales(scales, num_slots)
    _check_slots(token_slots, x.shape[0])
    _check_same_device([x, lora_a, lora_b, scales, token_slots])


def _check_attention_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_dims: str,
                              block_tables: torch.Tensor | None = None) -> None:
    """``q: [rows, H, d]`` (``q_dims`` names its dims) and ``k_cache, v_cache`` alike, ``[S, KV, L, d]`` (slot
    layout) or, with ``block_tables``, ``[NB, KV, BS, d]`` (paged: ``block_tables`` a contiguous 2-D int32
    ``[R, M]`` on ``q``'s device); the caches in ``q``'s dtype or both :data:`FP8_CACHE_DTYPE`, ``H`` a multiple of
    ``KV``."""
    if q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be {q_dims} in one of {FLOAT_DTYPES}, got {tuple(q.shape)} {q.dtype}")
    layout = "[S, KV, L, d]" if block_tables is None else "[NB, KV, BS, d] (paged)"
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be {layout}, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if block_tables is not None:
        if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            raise ValueError(f"block_tables must be a contiguous 2-D [R, M] int32 tensor, got {tuple(block_tables.shape)} "
                             f"{block_tables.dtype} strides {block_tables.stride()}")
        if block_tables.device != q.device:
            raise ValueError(f"block_tables is on {block_tables.device}, q on {q.device}")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"the cache's head dim is {k_cache.shape[3]}, q's is {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_CACHE_DTYPE):
        raise ValueError(f"k_cache/v_cache are {k_cache.dtype}/{v_cache.dtype}, q is {q.dtype}: use one dtype "
                         f"(or a {FP8_CACHE_DTYPE} cache for both)")


def check_attention_head_dim(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, max_head_dim: int) -> None:
    """What the Triton attention kernels need of checked operands: a head dim of at most ``max_head_dim``, unit
    stride along it."""
    head_dim = q.shape[2]
    if head_dim > max_head_dim:
        raise ValueError(f"head dim {head_dim} exceeds the Triton kernel's {max_head_dim}: use backend='torch'")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and head_dim > 1:
            raise ValueError(f"{name} must have unit stride along the head dim, got strides {t.stride()}")


def check_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None,
    max_head_dim: int,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
) -> None:
    """Checks the arguments of ``decode_attention`` for the Triton path (see ``reference.decode_attention_ref``):
    the slot layout needs a cache row per row of ``q``, the paged one a table row per row of ``q``."""
    if (prefix_rows is None) != (prefix_lens is None):
        raise ValueError("prefix_rows and prefix_lens go together: give both or neither")
    for name, t in (("prefix_rows", prefix_rows), ("prefix_lens", prefix_lens)):
        if t is not None and (t.shape != (q.shape[0],) or t.dtype not in (torch.int32, torch.int64) or t.device != q.device):
            raise ValueError(f"{name} must be [B] int32/int64 on q's device, got {tuple(t.shape)} {t.dtype} {t.device}")
    _check_attention_operands(q, k_cache, v_cache, "[B, H, d]", block_tables)
    check_attention_head_dim(q, k_cache, v_cache, max_head_dim)
    B, D = q.shape[0], q.shape[2]
    rows, what = (k_cache.shape[0], "cache") if block_tables is None else (block_tables.shape[0], "block table")
    if rows < B:
        raise ValueError(f"the {what} has {rows} rows, q has {B}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or (out.stride(-1) != 1 and D > 1):
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit last stride, got {tuple(out.shape)} {out.dtype}")
    if lengths.dim() != 1 or lengths.shape[0] != B or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be [{B}] int32/int64, got {tuple(lengths.shape)} {lengths.dtype}")
    if not lengths.is_contiguous():
        raise ValueError("lengths must be contiguous")
    _check_same_device([q, k_cache, v_cache, lengths] + ([out] if out is not None else []))


def check_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    job_rows: torch.Tensor,
    job_starts: torch.Tensor,
    q_offsets: torch.Tensor,
    q_lens: torch.Tensor,
    block_tables: torch.Tensor | None = None,
) -> None:
    """Checks the arguments of ``prefill_attention`` (both paths; see ``reference.prefill_attention_ref``):
    shapes, dtypes and devices, for the slot or (with ``block_tables``) the paged layout."""
    _check_attention_operands(q, k_cache, v_cache, "[T, H, d]", block_tables)
    metadata = (job_rows, job_starts, q_offsets, q_lens)
    for name, t in zip(PREFILL_METADATA, metadata):
        if t.dim() != 1 or t.dtype != torch.int64 or t.shape != job_rows.shape:
            raise ValueError(f"{', '.join(PREFILL_METADATA)} must be 1-D int64 of one length, got {name} "
                             f"{tuple(t.shape)} {t.dtype}")
    _check_same_device([q, k_cache, v_cache, *metadata])


def check_rows_op(name: str, x: torch.Tensor, width: int, residual: torch.Tensor | None) -> None:
    """``x`` (and ``residual``) must be float ``[N, width]`` tensors of one dtype with unit column stride."""
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a float [N, {width}] tensor with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()} {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must have unit column stride, {name}'s shape {tuple(x.shape)} and dtype {x.dtype}; "
                         f"got {tuple(residual.shape)} strides {residual.stride()} {residual.dtype}")


def check_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> None:
    """``gate`` and ``up`` must have one shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")


def check_chosen_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """``logits: [N, V]`` with unit column stride and ``targets: [N]`` int64 on one device."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"chosen_logprobs_ needs logits [N, V] with unit column stride, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if targets.shape != (logits.shape[0],) or targets.dtype != torch.int64 or targets.device != logits.device:
        raise ValueError(f"chosen_logprobs_ needs int64 targets [{logits.shape[0]}] on {logits.device}, got "
                         f"{targets.dtype} {tuple(targets.shape)} on {targets.device}")


def check_frozen_base(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A LoRA layer's base ``weight`` (and ``bias``) must not require gradients."""
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("the base layer must be frozen (requires_grad=False): only LoRA weights get gradients")
