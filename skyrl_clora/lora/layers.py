"""Multi-LoRA linear layers for a Hugging Face causal LM.

Every targeted ``nn.Linear`` of the model is replaced by a :class:`MultiLoRALinear` that keeps the frozen
base layer and a stack of adapter slots. Which slot each token row uses is set once per forward pass on
the model's :class:`LoRARouting` (shared by all its layers), so the HF forward code runs unchanged.

Two kinds of slot stacks exist:
- inference slots (``trainable=False``): buffers written in place by the sampler's sync
  (``copy_`` into the same storage, so CUDA graphs and cached pointers stay valid); applied with
  :func:`skyrl_clora.kernels.add_lora` under ``no_grad``.
- training slots (``trainable=True``): ``nn.Parameter`` stacks, one slot per tenant being trained in the
  pass (1 in swap mode, P in packed mode), applied with the base layer by the autograd op
  :func:`skyrl_clora.kernels.lora_linear` (the base layer plus ``packed_lora``), or by
  :func:`skyrl_clora.kernels.dense_lora_linear` when the routing names one slot for every row.

Shapes (PEFT/vLLM layout): ``lora_a: [S, R, H_in]``, ``lora_b: [S, H_out, R]``, ``scales: [S]`` fp32,
where ``R`` is the maximum rank; a slot of rank ``r < R`` has zero rows/columns beyond ``r``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from skyrl_clora.kernels import LoRAMeta, add_lora, dense_lora_linear, lora_linear

TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRARouting:
    """Per-model routing of token rows to adapter slots for the current forward pass.

    ``token_slots``: ``[T]`` int64 over the flattened ``[batch * seq]`` rows of the forward input, ``-1``
    for rows that use the base model alone; ``None`` means no LoRA at all. ``meta``: the kernels'
    segment metadata already built from ``token_slots`` (shared by every layer of the pass), or ``None``.
    ``single_slot``: the one slot of the pass, set by a caller whose rows all use it except padding whose
    outputs reach no real row (the trainer's right padding): training layers then run that adapter as one
    dense LoRA over every row (``kernels.dense_lora_linear``); else ``None``.
    """

    token_slots: torch.Tensor | None = None
    meta: LoRAMeta | None = None
    single_slot: int | None = None

    @contextlib.contextmanager
    def route(self, token_slots: torch.Tensor | None, meta: LoRAMeta | None = None,
              single_slot: int | None = None) -> Iterator[None]:
        """Routes rows to slots for the duration of the ``with`` block (not re-entrant across threads:
        each model tree has its own routing and is driven by one thread at a time)."""
        previous = self.token_slots, self.meta, self.single_slot
        self.token_slots, self.meta, self.single_slot = token_slots, meta, single_slot
        try:
            yield
        finally:
            self.token_slots, self.meta, self.single_slot = previous


class MultiLoRALinear(nn.Module):
    """``y = base(x) + scales[s] * (x @ A[s].T) @ B[s].T`` for each row's slot ``s`` (none when ``s == -1``)."""

    def __init__(
        self, base: nn.Linear, num_slots: int, max_rank: int, routing: LoRARouting, trainable: bool
    ) -> None:
        super().__init__()
        self.base = base
        self.routing = routing
        self.trainable = trainable
        self.in_features = base.in_features
        self.out_features = base.out_features
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        lora_a = torch.zeros(num_slots, max_rank, base.in_features, **factory)
        lora_b = torch.zeros(num_slots, base.out_features, max_rank, **factory)
        scales = torch.zeros(num_slots, device=base.weight.device, dtype=torch.float32)
        if trainable:
            self.lora_a = nn.Parameter(lora_a)
            self.lora_b = nn.Parameter(lora_b)
        else:
            self.register_buffer("lora_a", lora_a, persistent=False)
            self.register_buffer("lora_b", lora_b, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token_slots = self.routing.token_slots
        if token_slots is None:
            return self.base(x)
        flat_x = x.reshape(-1, self.in_features)
        if self.trainable:  # base layer and adapters in one autograd node
            if self.routing.single_slot is not None:
                flat_y = dense_lora_linear(flat_x, self.base.weight, self.base.bias, self.lora_a, self.lora_b,
                                           self.scales, self.routing.single_slot)
            else:
                flat_y = lora_linear(flat_x, self.base.weight, self.base.bias, self.lora_a, self.lora_b, self.scales,
                                     token_slots, meta=self.routing.meta)
            return flat_y.view(*x.shape[:-1], self.out_features)
        y = self.base(x)
        flat_y = y.view(-1, self.out_features)
        with torch.no_grad():
            add_lora(flat_y, flat_x, self.lora_a, (self.lora_b,), self.scales, token_slots, meta=self.routing.meta)
        return y


def attach_multi_lora(
    model: nn.Module,
    num_slots: int,
    max_rank: int,
    trainable: bool,
    target_modules: tuple[str, ...] = TARGET_MODULES,
) -> tuple[LoRARouting, dict[str, MultiLoRALinear]]:
    """Replaces every ``nn.Linear`` whose attribute name is in ``target_modules`` by a :class:`MultiLoRALinear`.

    Returns the model's routing object and the new layers keyed by their module path in the model
    (e.g. ``model.layers.0.self_attn.q_proj``), in a stable order. Base weights are frozen.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    routing = LoRARouting()
    layers: dict[str, MultiLoRALinear] = {}
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in target_modules and isinstance(child, nn.Linear):
                layer = MultiLoRALinear(child, num_slots, max_rank, routing, trainable)
                setattr(module, child_name, layer)
                layers[f"{path}.{child_name}" if path else child_name] = layer
    if not layers:
        raise ValueError(f"no nn.Linear named any of {target_modules} in the model; set lora target_modules")
    return routing, layers


@dataclass
class AdapterWeights:
    """One tenant's adapter in PEFT layout: per layer path, ``A: [r, H_in]`` and ``B: [H_out, r]``."""

    rank: int
    alpha: float
    a: dict[str, torch.Tensor] = field(default_factory=dict)
    b: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def write_slot(layers: dict[str, MultiLoRALinear], slot: int, adapter: AdapterWeights | None) -> None:
    """Copies ``adapter`` into ``slot`` of every layer in place (zero-padding ranks below the max);
    ``None`` clears the slot. Storage is never reallocated.

    Multi-tensor ops, none of which waits for the device: a copy from pinned host memory (the trainer's
    swapped-out weights) runs asynchronously in stream order, so its source must not change afterwards
    (the trainer hands out a fresh buffer per step); pageable sources are copied synchronously by CUDA."""
    with torch.no_grad():
        layer_list = list(layers.values())
        torch._foreach_zero_([layer.lora_a[slot] for layer in layer_list] + [layer.lora_b[slot] for layer in layer_list])
        scale = 0.0 if adapter is None else adapter.scale
        source = torch.full((1,), scale, device=layer_list[0].scales.device, dtype=layer_list[0].scales.dtype)
        torch._foreach_copy_([layer.scales[slot : slot + 1] for layer in layer_list], [source] * len(layer_list))
        if adapter is None:
            return
        paths = list(layers)
        targets = [layers[path].lora_a[slot, : adapter.rank] for path in paths]
        targets += [layers[path].lora_b[slot, :, : adapter.rank] for path in paths]
        sources = [adapter.a[path] for path in paths] + [adapter.b[path] for path in paths]
        torch._foreach_copy_(targets, sources, non_blocking=True)


def read_slot(layers: dict[str, MultiLoRALinear], slot: int, rank: int, alpha: float) -> AdapterWeights:
    """Returns a detached copy of ``slot``'s first ``rank`` ranks as :class:`AdapterWeights`."""
    adapter = AdapterWeights(rank=rank, alpha=alpha)
    for path, layer in layers.items():
        adapter.a[path] = layer.lora_a[slot, :rank].detach().clone()
        adapter.b[path] = layer.lora_b[slot, :, :rank].detach().clone()
    return adapter
