"""Per-tenant training state in host memory, swapped into the trainer's device slots for each step.

A tenant's state: its LoRA weights in the model dtype (what the sampler and the PEFT export get), the
fp32 master weights, the Adam moments, the last gradients, the optimizer step count, its RNG state and
its learning-rate schedule. Host tensors are pinned when CUDA is present so swaps can be asynchronous.

Per LoRA parameter key ``"<layer path>.a"`` (``[r, H_in]``) or ``"<layer path>.b"`` (``[H_out, r]``), at
the tenant's own rank ``r``; a device slot holds the max rank ``R`` and is zero beyond ``r``.

Swap algorithm (``swap_in(name, slot)`` then ``swap_out(slot)``):
  1. swap_in checks that ``slot`` is free and ``name`` is not already on the device (invariant: a tenant
     is in at most one slot, a slot holds at most one tenant; violations raise).
  2. It zeroes the slot's LoRA parameters, fp32 masters, moments and gradients, then copies the
     tenant's master weights into the masters and the LoRA parameters (cast to the model dtype), and its
     moments and gradients into the slot's, all in the first ``r`` ranks.
  3. It records the slot's owner and the tenant's rank/scale in the layers (``scales[slot]``).
  4. swap_out copies the slot's masters, moments and gradients back into the tenant's host tensors
     (``copy_``, storage kept), refreshes the model-dtype weights from the masters, and frees the slot.
Step counts, RNG states and schedules live only on the host and are read/written by the trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear


@dataclass(frozen=True)
class LRSchedule:
    """``lr(step)``: linear warm-up over ``warmup_steps`` then ``kind`` ("constant" or "cosine" to 0 at
    ``total_steps``)."""

    base_lr: float
    warmup_steps: int = 0
    total_steps: int = 1
    kind: str = "constant"

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine"):
            raise ValueError(f"unknown lr schedule {self.kind!r}; use constant or cosine")
        if self.base_lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {self.base_lr}")

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.kind == "cosine":
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
            return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.base_lr


@dataclass
class TenantState:
    """Everything that makes one tenant's training resumable (host memory)."""

    name: str
    rank: int
    alpha: float
    schedule: LRSchedule
    weights: AdapterWeights
    master: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    rng_state: torch.Tensor
    step: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class DeviceSlot:
    """fp32 optimizer tensors of one device slot, per key, at the max rank."""

    master: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    owner: str | None = None


class AdapterStore:
    """Host-resident tenant states plus the trainer's device slots (see module docstring)."""

    def __init__(self, layers: dict[str, MultiLoRALinear], num_slots: int) -> None:
        first = next(iter(layers.values()))
        if not first.trainable:
            raise ValueError("the AdapterStore needs trainable multi-LoRA layers (the trainer's model)")
        self.layers = layers
        self.max_rank = first.lora_a.shape[1]
        self.device = first.lora_a.device
        self.signature = {path: (layer.in_features, layer.out_features) for path, layer in layers.items()}
        self.tenants: dict[str, TenantState] = {}
        self.slots = [self._new_slot() for _ in range(num_slots)]
        self._pin = torch.cuda.is_available()

    def _new_slot(self) -> DeviceSlot:
        slot = DeviceSlot()
        for path, layer in self.layers.items():
            for key, shape in ((f"{path}.a", layer.lora_a.shape[1:]), (f"{path}.b", layer.lora_b.shape[1:])):
                for table in (slot.master, slot.exp_avg, slot.exp_avg_sq):
                    table[key] = torch.zeros(shape, device=self.device, dtype=torch.float32)
        return slot

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to("cpu", copy=True).contiguous()
        return tensor.pin_memory() if self._pin else tensor

    def register(self, name: str, weights: AdapterWeights, schedule: LRSchedule, seed: int) -> None:
        """Adds a tenant whose adapter starts at ``weights`` (fp32, PEFT layout)."""
        if name in self.tenants:
            raise ValueError(f"tenant {name!r} is already registered")
        if weights.rank > self.max_rank:
            raise ValueError(f"tenant {name!r} rank {weights.rank} exceeds lora.max_rank={self.max_rank}")
        if set(weights.a) != set(self.signature):
            raise ValueError(f"tenant {name!r} adapter targets {sorted(weights.a)[:3]}... differ from the model's LoRA layers")
        master: dict[str, torch.Tensor] = {}
        for path, (fan_in, fan_out) in self.signature.items():
            if tuple(weights.a[path].shape) != (weights.rank, fan_in) or tuple(weights.b[path].shape) != (fan_out, weights.rank):
                raise ValueError(f"tenant {name!r} adapter shape mismatch at {path}")
            master[f"{path}.a"] = self._host(weights.a[path].float())
            master[f"{path}.b"] = self._host(weights.b[path].float())
        zeros = lambda: {key: self._host(torch.zeros_like(t)) for key, t in master.items()}  # noqa: E731
        generator = torch.Generator().manual_seed(seed)
        state = TenantState(
            name=name, rank=weights.rank, alpha=weights.alpha, schedule=schedule,
            weights=AdapterWeights(rank=weights.rank, alpha=weights.alpha),
            master=master, exp_avg=zeros(), exp_avg_sq=zeros(), grads=zeros(), rng_state=generator.get_state(),
        )
        self._refresh_weights(state)
        self.tenants[name] = state

    def remove(self, name: str) -> None:
        if any(slot.owner == name for slot in self.slots):
            raise ValueError(f"tenant {name!r} is on the device; swap it out first")
        del self.tenants[name]

    def swap_in(self, name: str, slot_index: int) -> TenantState:
        """Steps 1-3 of the swap algorithm; returns the tenant's host state."""
        state = self.tenants[name]
        slot = self.slots[slot_index]
        if slot.owner is not None:
            raise RuntimeError(f"device slot {slot_index} still holds {slot.owner!r}")
        if any(s.owner == name for s in self.slots):
            raise RuntimeError(f"tenant {name!r} is already on the device")
        r = state.rank
        with torch.no_grad():
            for path, layer in self.layers.items():
                for key, param, rows in ((f"{path}.a", layer.lora_a, slice(0, r)), (f"{path}.b", layer.lora_b, None)):
                    index = (slice(None), slice(0, r)) if rows is None else (rows,)
                    for device_t, host_t in ((slot.master[key], state.master[key]), (slot.exp_avg[key], state.exp_avg[key]),
                                             (slot.exp_avg_sq[key], state.exp_avg_sq[key])):
                        device_t.zero_()
                        device_t[index].copy_(host_t, non_blocking=True)
                    param[slot_index].copy_(slot.master[key])
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    param.grad[slot_index].zero_()
                    param.grad[slot_index][index].copy_(state.grads[key], non_blocking=True)
                layer.scales[slot_index] = state.scale
        slot.owner = name
        return state

    def swap_out(self, slot_index: int) -> TenantState:
        """Step 4 of the swap algorithm; returns the tenant's host state."""
        slot = self.slots[slot_index]
        if slot.owner is None:
            raise RuntimeError(f"device slot {slot_index} is empty")
        state = self.tenants[slot.owner]
        r = state.rank
        with torch.no_grad():
            for path, layer in self.layers.items():
                for key, param, is_a in ((f"{path}.a", layer.lora_a, True), (f"{path}.b", layer.lora_b, False)):
                    index = (slice(0, r),) if is_a else (slice(None), slice(0, r))
                    state.master[key].copy_(slot.master[key][index])
                    state.exp_avg[key].copy_(slot.exp_avg[key][index])
                    state.exp_avg_sq[key].copy_(slot.exp_avg_sq[key][index])
                    state.grads[key].copy_(param.grad[slot_index][index])
                layer.scales[slot_index] = 0.0
        self._refresh_weights(state)
        slot.owner = None
        return state

    def _refresh_weights(self, state: TenantState) -> None:
        """Model-dtype weights (what the sampler and the export get) from the fp32 masters."""
        dtype = next(iter(self.layers.values())).lora_a.dtype
        for path in self.signature:
            state.weights.a[path] = state.master[f"{path}.a"].to(dtype, copy=True)
            state.weights.b[path] = state.master[f"{path}.b"].to(dtype, copy=True)
