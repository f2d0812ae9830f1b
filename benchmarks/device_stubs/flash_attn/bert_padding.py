"""``pad_input`` / ``unpad_input`` with flash-attn 2's signatures and results, in plain torch (see ``__init__``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """``hidden_states`` ``[B, S, ...]`` and ``attention_mask`` ``[B, S]`` (1 = token) -> the tokens ``[nnz, ...]``
    in row-major order, their flat indices ``[nnz]``, ``cu_seqlens`` ``[B + 1]`` (int32), the longest row's length
    and each row's used length ``[B]`` (int32). ``unused_mask`` marks tokens kept but not counted as used."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()), used_seqlens


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``[nnz, ...]`` tokens back to ``[batch, seqlen, ...]``, zeros elsewhere."""
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], device=hidden_states.device, dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])
