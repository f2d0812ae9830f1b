"""Picks the implementation of each multi-LoRA op by device: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from skyrl_clora.kernels.reference import add_lora_ref, packed_lora_ref


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """In place: ``out[t, slice_i] += scales[s] * (x[t] @ A[s].T) @ B_i[s].T`` for ``s = token_slots[t] >= 0``.

    See :func:`skyrl_clora.kernels.reference.add_lora_ref` for shapes and exact semantics.
    """
    add_lora_ref(out, x, lora_a, lora_b, scales, token_slots)


def packed_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """Returns ``y[t] = scales[p] * (x[t] @ A[p].T) @ B[p].T`` for ``p = token_slots[t] >= 0`` (autograd).

    See :func:`skyrl_clora.kernels.reference.packed_lora_ref`.
    """
    return packed_lora_ref(x, lora_a, lora_b, scales, token_slots)
