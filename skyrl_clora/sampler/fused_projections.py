"""The engine's decoder-layer projections: fused where they share an input, LoRA A folded into the weights.

A decode step runs each layer's seven projections at M = the step's rows (tens to hundreds): short GEMMs and
multi-LoRA shrink/expand pairs, bound by launch latency and by the CUDA graph's node count rather than by the
bytes they move. The engine runs a layer as four projections, q/k/v, o, gate/up and down, each one GEMM
over a :class:`~skyrl_clora.kernels.FoldedWeights` (``kernels.lora.folded``) and one segmented LoRA expand:

- :func:`fuse_base_projections` concatenates the base weights (and biases) of the projections that read
  the same input (q/k/v, gate/up; o and down alone) and appends rows for every adapter slot's LoRA A below
  them. Each module's own weight becomes a view of the folded matrix: no base weight is duplicated, and a
  model that shares these tensors (the trainer's twin, built afterwards from the state dict) keeps sharing
  them.
- :func:`attach_engine_lora` makes a model's projections the engine's in one call: it folds them, attaches
  inference :class:`MultiLoRALinear` layers and makes each layer's ``lora_a`` a view of its folded matrix's A
  rows (so in-place publishes into a layer's slot land in the GEMM's weight), with one ``scales`` buffer per
  group.
- :func:`fused_layer_projections` reads those layers as one :class:`FusedProjection` per group, each one
  ``kernels.folded_lora_linear`` call (q/k/v: one ``kernels.folded_qkv_rope`` call, its expand inside the q/k
  norm + rotary kernel; the model runner makes it); it refuses layers that :func:`attach_engine_lora` did not make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from skyrl_clora.kernels import FoldedWeights, LoRAMeta, fold_lora_weights, folded_lora_linear
from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear, attach_multi_lora

# (owner module, projections reading one input, attribute holding their FoldedWeights on the owner)
GROUPS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "folded_qkv"),
    ("self_attn", ("o_proj",), "folded_o"),
    ("mlp", ("gate_proj", "up_proj"), "folded_gate_up"),
    ("mlp", ("down_proj",), "folded_down"),
)


@dataclass
class FusedProjection:
    """Projections of one input run as one: ``y = x @ base_weight.T + base_bias`` over ``folded``, plus each
    row's slot LoRA of every slice (``folded.lora_a: [slices, S, R, H_in]``, ``lora_b[i]: [S, sizes[i], R]``,
    ``scales: [S]``), split into the slices' outputs ``[T, sizes[i]]``."""

    folded: FoldedWeights
    sizes: list[int]
    lora_b: tuple[torch.Tensor, ...]
    scales: torch.Tensor

    def __call__(self, x: torch.Tensor, token_slots: torch.Tensor | None, meta: LoRAMeta | None) -> list[torch.Tensor]:
        """``x: [T, H_in]`` -> the slices' outputs (column views of one ``[T, >= sum(sizes)]`` tensor)."""
        y = folded_lora_linear(x, self.folded, self.lora_b, self.scales, token_slots, meta=meta)
        return list(y.split(self.sizes, dim=-1))


class LayerProjections(NamedTuple):
    """One decoder layer's projections, in the order the layer runs them."""

    qkv: FusedProjection
    o: FusedProjection
    gate_up: FusedProjection
    down: FusedProjection


def _linear(module: nn.Module) -> nn.Linear:
    return module.base if isinstance(module, MultiLoRALinear) else module


def fuse_base_projections(decoder_layers: nn.ModuleList, num_slots: int, max_rank: int) -> None:
    """Folds every layer's projection groups (see module docstring) with zeroed A rows for ``num_slots``
    adapter slots of rank ``max_rank``; the :class:`FoldedWeights` are kept as ``folded_*`` attributes of the
    attention / MLP module. Idempotent for the same slots and rank. Raises ValueError for a layer whose
    projections are missing or mix biased and unbiased, or that was folded for other slots or rank."""
    with torch.no_grad():
        for index, layer in enumerate(decoder_layers):
            for owner_name, names, attribute in GROUPS:
                owner = getattr(layer, owner_name)
                folded = getattr(owner, attribute, None)
                if folded is not None:
                    if (folded.num_slots, folded.rank) != (num_slots, max_rank):
                        raise ValueError(f"decoder layer {index} was folded for {folded.num_slots} slots of rank "
                                         f"{folded.rank}, not {num_slots} of rank {max_rank}")
                    continue
                if not all(hasattr(owner, name) for name in names):
                    raise ValueError(f"decoder layer {index}: the engine needs {owner_name}.{'/'.join(names)} projections")
                linears = [_linear(getattr(owner, name)) for name in names]
                if len({linear.bias is None for linear in linears}) != 1:
                    raise ValueError(f"decoder layer {index}: {owner_name} mixes biased and unbiased projections")
                weight = torch.cat([linear.weight for linear in linears])
                bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
                lora_a = weight.new_zeros(len(names), num_slots, max_rank, weight.shape[1])
                folded = fold_lora_weights(weight, bias, lora_a)
                start = 0
                for linear in linears:
                    end = start + linear.out_features
                    linear.weight.data = folded.weight[start:end]
                    if bias is not None:
                        linear.bias.data = folded.bias[start:end]
                    start = end
                setattr(owner, attribute, folded)


def attach_engine_lora(model: nn.Module, num_slots: int, max_rank: int) -> tuple[LoRARouting, dict[str, MultiLoRALinear]]:
    """Makes ``model``'s decoder projections the engine's, in place, in this order:

    1. their base weights are folded with zeroed A rows for ``num_slots`` slots of rank ``max_rank``
       (:func:`fuse_base_projections`; nothing to do when they are folded for these already);
    2. inference :class:`MultiLoRALinear` layers are attached (``attach_multi_lora(trainable=False)``);
    3. each layer's ``lora_a`` (``[S, R, H_in]``) becomes the view of its folded A rows, and each group's layers
       share one ``scales`` buffer.
    Returns ``attach_multi_lora``'s (routing, layers): a write into a layer's slot (``write_slot``, the engine's
    publishes) changes the weight the engine's GEMM reads."""
    fuse_base_projections(model.model.layers, num_slots, max_rank)
    routing, layers = attach_multi_lora(model, num_slots, max_rank, trainable=False)
    for layer in model.model.layers:
        for owner_name, names, attribute in GROUPS:
            owner = getattr(layer, owner_name)
            modules = [getattr(owner, name) for name in names]
            for view, module in zip(_a_views(getattr(owner, attribute), len(modules)), modules):
                module.lora_a = view  # both zero: the slots are empty
                module.scales = modules[0].scales
    return routing, layers


def _a_views(folded: FoldedWeights, slices: int) -> list[torch.Tensor]:
    """The folded matrix's A rows per projection of its group, each ``[S, R, H_in]``."""
    return list(folded.lora_a) if slices > 1 else [folded.lora_a]


def fused_layer_projections(decoder_layers: nn.ModuleList) -> list[LayerProjections]:
    """Per layer, its four :class:`FusedProjection` over the layers :func:`attach_engine_lora` made. Raises
    ValueError for a group whose layers are not inference :class:`MultiLoRALinear` layers with ``lora_a`` views of
    its folded A rows and one shared ``scales``."""
    fused = []
    for layer in decoder_layers:
        group = []
        for owner_name, names, attribute in GROUPS:
            owner = getattr(layer, owner_name)
            layers = [getattr(owner, name) for name in names]
            if not all(isinstance(m, MultiLoRALinear) and not m.trainable for m in layers):
                raise ValueError(f"{owner_name}.{'/'.join(names)} must be inference MultiLoRALinear layers (attach_engine_lora) "
                                 "before the engine runs them")
            folded: FoldedWeights | None = getattr(owner, attribute, None)
            views = _a_views(folded, len(layers)) if folded is not None else []
            if folded is None or any(m.lora_a.data_ptr() != view.data_ptr() or m.lora_a.shape != view.shape
                                     or m.scales is not layers[0].scales for view, m in zip(views, layers)):
                raise ValueError(f"{owner_name}.{'/'.join(names)}: the LoRA A buffers are not views of the folded weight; "
                                 "attach the engine's LoRA layers with attach_engine_lora")
            group.append(FusedProjection(folded, [m.out_features for m in layers], tuple(m.lora_b for m in layers),
                                         layers[0].scales))
        fused.append(LayerProjections(*group))
    return fused
