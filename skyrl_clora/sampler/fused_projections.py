"""Fused q/k/v and gate/up projections with their multi-LoRA, for the engine's decoder layers.

A decode step runs each layer's seven projections at M = the step's rows (tens): seven short GEMMs and
seven LoRA shrink/expand pairs, bound by launch latency and by the CUDA graph's node count rather than by
the bytes they move. The engine runs the projections that read the same input as one:

- :func:`fuse_base_projections` concatenates a layer's q/k/v weights (and biases) into one matrix and its
  gate/up weights into another, and makes each module's own weight a view into the fused matrix: no
  memory is duplicated, and a model that shares these tensors (the trainer's twin, built afterwards from
  the state dict) keeps sharing them.
- :func:`fused_layer_projections` stacks the slices' LoRA A buffers into one ``[slices, S, R, H_in]``
  tensor (each layer's ``lora_a`` becomes a view of it, so in-place publishes still land) and shares one
  ``scales`` buffer, so each group's LoRA is one multi-slice ``add_lora`` call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from skyrl_clora.kernels import LoRAMeta, add_lora
from skyrl_clora.lora.layers import MultiLoRALinear

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "fused_qkv"), ("mlp", ("gate_proj", "up_proj"), "fused_gate_up"))


@dataclass
class FusedProjection:
    """Projections of one input run as one: ``y = x @ weight.T + bias`` (``weight: [sum(sizes), H_in]``),
    plus each row's slot LoRA of every slice (``lora_a: [slices, S, R, H_in]``, ``lora_b[i]: [S, sizes[i], R]``,
    ``scales: [S]``), split into the slices' outputs ``[T, sizes[i]]``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]
    lora_a: torch.Tensor
    lora_b: tuple[torch.Tensor, ...]
    scales: torch.Tensor

    def __call__(self, x: torch.Tensor, token_slots: torch.Tensor | None, meta: LoRAMeta | None) -> list[torch.Tensor]:
        """``x: [T, H_in]`` -> the slices' outputs (column views of one ``[T, sum(sizes)]`` tensor)."""
        y = F.linear(x, self.weight, self.bias)
        if token_slots is not None:
            add_lora(y, x, self.lora_a, self.lora_b, self.scales, token_slots, meta=meta)
        return list(y.split(self.sizes, dim=-1))


def _linear(module: nn.Module) -> nn.Linear:
    return module.base if isinstance(module, MultiLoRALinear) else module


def fuse_base_projections(decoder_layers: nn.ModuleList) -> None:
    """Fuses every layer's q/k/v and gate/up weights (see module docstring); the fused matrices are kept as
    ``fused_qkv`` / ``fused_gate_up`` ``(weight, bias)`` attributes of the attention / MLP module.
    Idempotent. Raises ValueError for a layer whose projections are missing or mix biased and unbiased."""
    with torch.no_grad():
        for index, layer in enumerate(decoder_layers):
            for owner_name, names, attribute in GROUPS:
                owner = getattr(layer, owner_name)
                if hasattr(owner, attribute):
                    continue
                if not all(hasattr(owner, name) for name in names):
                    raise ValueError(f"decoder layer {index}: the engine needs {owner_name}.{'/'.join(names)} projections")
                linears = [_linear(getattr(owner, name)) for name in names]
                if len({linear.bias is None for linear in linears}) != 1:
                    raise ValueError(f"decoder layer {index}: {owner_name} mixes biased and unbiased projections")
                weight = torch.cat([linear.weight for linear in linears])
                bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
                start = 0
                for linear in linears:
                    end = start + linear.out_features
                    linear.weight.data = weight[start:end]
                    if bias is not None:
                        linear.bias.data = bias[start:end]
                    start = end
                setattr(owner, attribute, (weight, bias))


def fused_layer_projections(decoder_layers: nn.ModuleList) -> list[tuple[FusedProjection, FusedProjection]]:
    """Per layer, its q/k/v and gate/up :class:`FusedProjection` (fusing the base weights first if needed).
    The projections must be inference :class:`MultiLoRALinear` layers (``trainable=False``); their LoRA A
    buffers and scales are re-pointed into shared storage, keeping their values."""
    fuse_base_projections(decoder_layers)
    fused = []
    for layer in decoder_layers:
        pair = []
        for owner_name, names, attribute in GROUPS:
            owner = getattr(layer, owner_name)
            layers = [getattr(owner, name) for name in names]
            if not all(isinstance(m, MultiLoRALinear) and not m.trainable for m in layers):
                raise ValueError(f"{owner_name}.{'/'.join(names)} must be inference MultiLoRALinear layers (attach_multi_lora "
                                 "with trainable=False) before the engine fuses them")
            stacked = torch.stack([m.lora_a for m in layers])  # [slices, S, R, H_in]
            for position, module in enumerate(layers):
                module.lora_a = stacked[position]
                module.scales = layers[0].scales
            weight, bias = getattr(owner, attribute)
            pair.append(FusedProjection(weight, bias, [m.out_features for m in layers], stacked,
                                        tuple(m.lora_b for m in layers), layers[0].scales))
        fused.append((pair[0], pair[1]))
    return fused
