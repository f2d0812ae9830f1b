"""The dispatch of the attention block's q/k/v projection with q/k norm and rotary (``folded_qkv_rope``), and of
its variant that writes k and v into the sampling engine's slot K/V cache (``folded_qkv_rope_into_cache``): the
fused Triton kernel (``kernels.lora.qkv_rope``) for CUDA tensors, the torch reference elsewhere, as in ``dispatch``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skyrl_clora.kernels import dispatch
from skyrl_clora.kernels.dispatch import Backend, folded_lora_linear, qk_norm_rope
from skyrl_clora.kernels.lora.folded import FoldedWeights
from skyrl_clora.kernels.lora.meta import LoRAMeta
from skyrl_clora.kernels.lora.qkv_rope import KVCacheWrite, check_cache_write, folded_qkv_rope_triton


def folded_qkv_rope(
    x: torch.Tensor,
    folded: FoldedWeights,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    token_slots: torch.Tensor | None,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    *,
    meta: LoRAMeta | None = None,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention block's q/k/v projection, its multi-LoRA terms, q/k RMSNorm and rotary embedding in one
    call. ``folded`` and ``lora_b = (B_q, B_k, B_v)`` as for :func:`folded_lora_linear`, whose slices are q
    (``Hq * head_dim`` wide), k and v (``Hk * head_dim`` each); the rest as for :func:`qk_norm_rope`. Returns
    new ``q: [T, Hq, d]``, ``k, v: [T, Hk, d]``. Torch pseudo-code::

        q, k, v = folded_lora_linear(x, folded, lora_b, scales, token_slots).split(widths, -1)  # -> heads
        q, k = qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps)

    The Triton path (for ``token_slots`` not None and a power-of-two ``head_dim >= 32``, or when forced) runs
    the LoRA expand inside the norm + rotary kernel (``kernels.lora.qkv_rope``): one GEMM and one kernel at decode
    sizes, plus the shrink where the fold does not pay. ``meta`` as for :func:`add_lora`.
    """
    lora_b = tuple(lora_b)
    if _fused_qkv_rope(x, token_slots, head_dim, backend):
        return folded_qkv_rope_triton(x, folded, lora_b, scales, token_slots, head_dim, cos, sin, q_weight, k_weight,
                                      eps, meta=meta)
    y = folded_lora_linear(x, folded, lora_b, scales, token_slots, meta=meta, backend=backend)
    q, k, v = (t.reshape(x.shape[0], -1, head_dim) for t in y.split([b.shape[1] for b in lora_b], dim=-1))
    q, k = qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, backend=backend)
    return q, k, v.contiguous()


def folded_qkv_rope_into_cache(
    x: torch.Tensor,
    folded: FoldedWeights,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    token_slots: torch.Tensor | None,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: KVCacheWrite,
    *,
    meta: LoRAMeta | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """:func:`folded_qkv_rope` whose k and v go straight into a slot K/V cache (``cache``); returns ``q: [T, Hq,
    d]``. Torch pseudo-code::

        q, k, v = folded_qkv_rope(x, folded, lora_b, scales, token_slots, head_dim, cos, sin, q_weight, k_weight, eps)
        cache.k_cache[cache.rows, :, cache.positions] = k.to(cache.k_cache.dtype)   # fp8: scale 1.0
        cache.v_cache[cache.rows, :, cache.positions] = v.to(cache.v_cache.dtype)

    On the Triton path the fused kernel stores k and v there itself (no scatter kernels after it), the same bits
    (an fp8 cache: within e4m3's range, see :class:`KVCacheWrite`)."""
    lora_b = tuple(lora_b)
    if _fused_qkv_rope(x, token_slots, head_dim, backend):
        return folded_qkv_rope_triton(x, folded, lora_b, scales, token_slots, head_dim, cos, sin, q_weight, k_weight,
                                      eps, cache, meta=meta)[0]
    q, k, v = folded_qkv_rope(x, folded, lora_b, scales, token_slots, head_dim, cos, sin, q_weight, k_weight, eps,
                              meta=meta, backend=backend)
    check_cache_write(cache, x.shape[0], k.shape[1], head_dim, x)
    cache.k_cache[cache.rows, :, cache.positions] = k.to(cache.k_cache.dtype)
    cache.v_cache[cache.rows, :, cache.positions] = v.to(cache.v_cache.dtype)
    return q


def _fused_qkv_rope(x: torch.Tensor, token_slots: torch.Tensor | None, head_dim: int, backend: Backend | None) -> bool:
    """Whether the q/k/v block runs as the fused Triton kernel (a power-of-two head dim >= 32, or forced)."""
    fusable = head_dim >= 32 and not head_dim & (head_dim - 1)
    return token_slots is not None and dispatch.use_triton(x, backend) and (fusable or backend == "triton")
