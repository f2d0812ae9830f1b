"""Multi-LoRA inference layers whose LoRA shrink is folded into the base GEMM.

At decode sizes a multi-LoRA layer is bound by launches, not bytes: the segmented shrink ``x @ A[s].T`` and
expand ``h @ B[s].T`` (``sgmv``) are two short dependent kernels beside a base GEMM that itself only streams
its weight. Appending every slot's A below the base weight, ``W' = [W; A_0; ...; A_{S-1}]``, makes one GEMM
``x @ W'.T`` produce the base output and every slot's ``h`` (extra output columns); one segmented expand
(``sgmv.expand_folded``) then adds each row's own slot's term. The shrink's cost becomes the extra columns'
share of the GEMM: the A bytes it must read anyway at decode sizes, and ``T * S * R`` multiply-adds per
input feature at prefill sizes, where reading x once more is cheaper for many slots (``fold_pays``).
The LoRA add-on over the base GEMM, folded and unfolded, on the H200: RESULTS.md, Multi-LoRA kernels vs the base
GEMM.

The folded weight is the storage: the base weight and each slot's A are views of it, so in-place adapter
publishes (``copy_`` into ``lora_a``) land in the GEMM's weight and captured CUDA graphs stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from skyrl_clora.kernels.checks import check_add_lora
from skyrl_clora.kernels.lora.meta import LoRAMeta
from skyrl_clora.kernels.lora.sgmv import check_meta, default_config, expand_folded

# When the fold pays (``fold_pays``). At decode sizes the GEMM streams its weight, so the extra columns cost
# their bytes: the A bytes the shrink would read anyway; the fold saved a launch in every measured row up to a
# quarter of the base columns (Qwen3-4B q/k/v at 32 slots of rank 16). Beyond, the GEMM is compute-bound: an
# extra column costs 2 * T * H_in flops where the shrink reads x's 2 * T * H_in bytes once, which break even
# where the device's flops per byte of bandwidth say (a couple of hundred columns on an H200); at 4096 rows 128 and
# 256 extra columns folded faster, 384 and more slower (RESULTS.md, Multi-LoRA kernels vs the base GEMM).
_DECODE_TOKENS = 256
_DECODE_EXTRA_FRACTION = 1 / 4
_PREFILL_EXTRA_COLUMNS = 256


@dataclass(frozen=True)
class FoldedWeights:
    """A linear layer's base weight with every slot's LoRA A appended below it.

    ``weight: [H_out + slices * S * R, H_in]``: rows ``:H_out`` are the base weight, the rest every slot's A
    (one per output slice, or one shared by all slices: ``slices = 1``), slice-major then slot-major. ``bias``:
    ``[H_out + slices * S * R]`` with zeros past ``H_out``, or None.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    slices: int
    num_slots: int
    rank: int

    @property
    def base_weight(self) -> torch.Tensor:
        return self.weight[: self.out_features]

    @property
    def base_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias[: self.out_features]

    @property
    def lora_a(self) -> torch.Tensor:
        """A view of ``weight``, as ``add_lora`` takes it: ``[slices, S, R, H_in]``, or ``[S, R, H_in]`` for one A
        shared by every output slice (``slices = 1``)."""
        a = self.weight[self.out_features :].view(self.slices, self.num_slots, self.rank, self.weight.shape[1])
        return a[0] if self.slices == 1 else a

    @property
    def extra_features(self) -> int:
        return self.weight.shape[0] - self.out_features


def fold_lora_weights(weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor) -> FoldedWeights:
    """New storage ``[weight; lora_a]`` for ``weight: [H_out, H_in]``, ``bias: [H_out]`` (or None) and
    ``lora_a: [slices, S, R, H_in]`` of the same dtype and device (their values are copied)."""
    if lora_a.dim() != 4 or lora_a.shape[-1] != weight.shape[1] or lora_a.dtype != weight.dtype:
        raise ValueError(f"lora_a must be [slices, S, R, {weight.shape[1]}] {weight.dtype}, got "
                         f"{tuple(lora_a.shape)} {lora_a.dtype}")
    slices, num_slots, rank, h_in = lora_a.shape
    folded = torch.cat([weight, lora_a.reshape(-1, h_in)])
    folded_bias = None if bias is None else torch.cat([bias, bias.new_zeros(slices * num_slots * rank)])
    return FoldedWeights(folded, folded_bias, weight.shape[0], slices, num_slots, rank)


def fold_pays(num_tokens: int, out_features: int, extra_features: int) -> bool:
    """Whether the folded GEMM beats base GEMM + segmented shrink for a batch of ``num_tokens`` rows."""
    if num_tokens <= _DECODE_TOKENS:
        return extra_features <= _DECODE_EXTRA_FRACTION * out_features
    return extra_features <= _PREFILL_EXTRA_COLUMNS


def folded_meta(folded: FoldedWeights, x: torch.Tensor, token_slots: torch.Tensor, meta: LoRAMeta | None) -> LoRAMeta:
    """The meta of a folded layer's batch: ``meta`` (built from ``token_slots``), or when None a new one sized
    for this batch and ``folded`` (allocates); either way checked against ``x`` and ``folded``'s slots."""
    if meta is None:
        meta = LoRAMeta.for_batch(token_slots, folded.num_slots, folded.rank, folded.slices)
    check_meta(meta, x, folded.num_slots)
    return meta


def folded_lora_linear_triton(
    x: torch.Tensor,
    folded: FoldedWeights,
    lora_b: tuple[torch.Tensor, ...],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    meta: LoRAMeta | None = None,
) -> torch.Tensor:
    """The folded path of ``dispatch.folded_lora_linear``: one GEMM over ``folded.weight`` and one
    ``expand_folded``. Returns ``[T, H_out]``, a column view of the GEMM's ``[T, H_out + extra]`` output
    (row stride ``H_out + extra``). With ``meta`` (built from ``token_slots``) nothing waits for the host;
    without it a meta is built here (``folded_meta``)."""
    meta = folded_meta(folded, x, token_slots, meta)
    y = F.linear(x, folded.weight, folded.bias)
    out = y[:, : folded.out_features]
    check_add_lora(out, x, folded.lora_a, lora_b, scales, token_slots)
    T = x.shape[0]
    if T:
        h = y[:, folded.out_features :].view(T, folded.slices, folded.num_slots, folded.rank)
        config = default_config(T, x.shape[1], folded.num_slots, folded.slices, folded.rank)
        expand_folded(out, h, lora_b, scales, meta, folded.rank, config)
    return out
