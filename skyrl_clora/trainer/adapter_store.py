"""Per-tenant training state in host memory, swapped into the trainer's device slots for each step.

A tenant's state: its LoRA weights in the model dtype (what the sampler and the PEFT export get), the
fp32 master weights, the Adam moments, the last gradients, the optimizer step count, its RNG state and
its learning-rate schedule. Host tensors are page-locked when CUDA is present, so swaps are asynchronous, in blocks
of their exact size (:mod:`skyrl_clora.device.pinned_memory`), so a tenant holds :meth:`AdapterStore.host_bytes`.

Per LoRA parameter key ``"<layer path>.a"`` (``[r, H_in]``) or ``"<layer path>.b"`` (``[H_out, r]``), at
the tenant's own rank ``r``; a device slot holds the max rank ``R`` and is zero beyond ``r``. Each table
(master, exp_avg, exp_avg_sq, grads) of a tenant is one flat host buffer whose per-key views are the
dict entries, so a swap moves one buffer per table. Each device slot has, besides its fp32 tables at
rank ``R``, a staging buffer per table in the tenant-rank flat layout: host<->device copies go through it
(the grads one is also AdamW's fp32 gradient scratch while the slot is swapped in). The LoRA gradients
are allocated once by the store, which keeps views of them: never replace ``param.grad``.

Swap algorithm (``prefetch(name, slot)`` or ``swap_in(name, slot)``, then ``swap_out(slot)``):
  1. prefetch checks that ``slot`` is free and ``name`` is in no slot (invariant: a tenant is in at most
     one slot, a slot holds at most one tenant; violations raise), then copies the tenant's host buffers
     into the slot's staging buffers on the side stream (CUDA; in order on the CPU) and records an event.
  2. swap_in (prefetching first unless ``name`` is already prefetched into ``slot``) makes the compute
     stream wait for that event, zeroes the slot's tables if ``r < R``, unpacks the staging buffers into
     the first ``r`` ranks of the slot's masters, moments and gradients, writes the masters into the LoRA
     parameters (model dtype) and the tenant's scale into the layers (``scales[slot]``).
  3. swap_out packs the slot's first ``r`` ranks (and the masters cast to the model dtype) into the
     staging buffers on the compute stream, records an event, and on the side stream copies them into the
     tenant's host buffers (and a fresh model-dtype weights buffer), then frees the slot. The host state is
     final once :meth:`AdapterStore.wait` returns; a later prefetch of the same tenant is ordered after it
     on the side stream.
  ``release(slot)`` frees a prefetched slot that was never swapped in (nothing to write back).
Step counts, RNG states and schedules live only on the host and are read/written by the trainer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from skyrl.train.config import AlgorithmConfig

from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear
from skyrl_clora.device.pinned_memory import host_empty
from skyrl_clora.trainer.lr_schedule import LRSchedule

TABLES = ("master", "exp_avg", "exp_avg_sq", "grads")


@dataclass
class TenantState:
    """Everything that makes one tenant's training resumable (host memory). ``master``, ``exp_avg``,
    ``exp_avg_sq`` and ``grads`` map each key to a view of ``flat[table]`` (fp32, tenant rank)."""

    name: str
    rank: int
    alpha: float
    schedule: LRSchedule
    weights: AdapterWeights
    flat: dict[str, torch.Tensor]
    master: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    rng_state: torch.Tensor
    step: int = 0
    kl_coef: float | None = None  # its reward KL controller's value (SkyRL's; None: not used yet, kl_loss_coef)
    algorithm: AlgorithmConfig | None = None  # its own SkyRL algorithm settings (None: the trainer's)
    weight_decay: float | None = None  # its own AdamW weight decay (None: the trainer's)
    max_grad_norm: float | None = None  # its own gradient clipping norm (None: the trainer's)
    pending: torch.cuda.Event | None = None  # set while a swap-out's copies into the host buffers are in flight

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class DeviceSlot:
    """fp32 optimizer tables of one device slot at the max rank (per table: key -> tensor), the staging
    buffers (per table: flat fp32, sized for the max rank; plus ``weights``: flat model dtype), the owner,
    whether it was swapped in (``active``) or only prefetched, and the event its staging copy-in records."""

    tables: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    staging: dict[str, torch.Tensor] = field(default_factory=dict)
    owner: str | None = None
    active: bool = False
    ready: torch.cuda.Event | None = None


class AdapterStore:
    """Host-resident tenant states plus the trainer's device slots (see module docstring)."""

    def __init__(self, layers: dict[str, MultiLoRALinear], num_slots: int) -> None:
        first = next(iter(layers.values()))
        if not first.trainable:
            raise ValueError("the AdapterStore needs trainable multi-LoRA layers (the trainer's model)")
        if num_slots > first.lora_a.shape[0]:
            raise ValueError(f"the AdapterStore needs {num_slots} slots but the layers have {first.lora_a.shape[0]}")
        self.layers = layers
        self.max_rank = first.lora_a.shape[1]
        self.device = first.lora_a.device
        self.dtype = first.lora_a.dtype
        self.signature = {path: (layer.in_features, layer.out_features) for path, layer in layers.items()}
        self.keys = [f"{path}.{part}" for path in layers for part in ("a", "b")]
        self.tenants: dict[str, TenantState] = {}
        cuda = self.device.type == "cuda"
        self._pin = cuda
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        for layer in layers.values():  # allocated once: the store keeps views of these gradients
            for param in (layer.lora_a, layer.lora_b):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        self.slots = [self._new_slot() for _ in range(num_slots)]
        self._view_cache: dict[tuple, list[torch.Tensor]] = {}

    # ---- layout -------------------------------------------------------------------------------------
    def shapes(self, rank: int) -> list[tuple[int, int]]:
        """Shapes of ``self.keys`` at ``rank``: ``[r, H_in]`` for A, ``[H_out, r]`` for B."""
        return [shape for fan_in, fan_out in self.signature.values() for shape in ((rank, fan_in), (fan_out, rank))]

    def _views(self, flat: torch.Tensor, rank: int) -> list[torch.Tensor]:
        views, offset = [], 0
        for rows, cols in self.shapes(rank):
            views.append(flat[offset : offset + rows * cols].view(rows, cols))
            offset += rows * cols
        return views

    def _numel(self, rank: int) -> int:
        return sum(rows * cols for rows, cols in self.shapes(rank))

    def host_bytes(self, rank: int) -> int:
        """Host bytes one registered tenant of ``rank`` holds: its fp32 tables (``TABLES``) and its model-dtype
        weights."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self._numel(rank) * (4 * len(TABLES) + itemsize)

    def _new_slot(self) -> DeviceSlot:
        slot = DeviceSlot()
        for table in TABLES[:3]:
            flat = torch.zeros(self._numel(self.max_rank), device=self.device, dtype=torch.float32)
            slot.tables[table] = dict(zip(self.keys, self._views(flat, self.max_rank)))
        for table in TABLES:
            slot.staging[table] = torch.zeros(self._numel(self.max_rank), device=self.device, dtype=torch.float32)
        slot.staging["weights"] = torch.zeros(self._numel(self.max_rank), device=self.device, dtype=self.dtype)
        return slot

    def _cached(self, key: tuple, build: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Views built once per key (every viewed buffer is allocated once and never replaced)."""
        views = self._view_cache.get(key)
        if views is None:
            views = self._view_cache[key] = build()
        return views

    def param_views(self, slot_index: int, grads: bool = False, rank: int | None = None) -> list[torch.Tensor]:
        """The slot's LoRA parameters (or their gradients) in ``self.keys`` order, at the max rank (or their
        first ``rank`` ranks)."""
        def build() -> list[torch.Tensor]:
            views = [(param.grad if grads else param.data)[slot_index]
                     for layer in self.layers.values() for param in (layer.lora_a, layer.lora_b)]
            return views if rank is None else self._rank_views(views, rank)

        return self._cached(("param", slot_index, grads, rank), build)

    def table_views(self, slot_index: int, table: str, rank: int | None = None) -> list[torch.Tensor]:
        """The slot's fp32 ``table`` (master, exp_avg, exp_avg_sq) in ``keys`` order, at the max rank (or its
        first ``rank`` ranks)."""
        def build() -> list[torch.Tensor]:
            views = list(self.slots[slot_index].tables[table].values())
            return views if rank is None else self._rank_views(views, rank)

        return self._cached(("table", slot_index, table, rank), build)

    def staging_views(self, slot_index: int, table: str, rank: int) -> list[torch.Tensor]:
        """The slot's staging buffer ``table`` viewed in the tenant-rank flat layout of ``rank``."""
        return self._cached(("staging", slot_index, table, rank),
                            lambda: self._views(self.slots[slot_index].staging[table], rank))

    def _set_scales(self, slot_index: int, value: float) -> None:
        """``scales[slot_index] = value`` in every layer, in one multi-tensor copy."""
        views = self._cached(("scales", slot_index), lambda: [layer.scales[slot_index : slot_index + 1]
                                                               for layer in self.layers.values()])
        source = torch.full((1,), value, device=self.device, dtype=torch.float32)
        torch._foreach_copy_(views, [source] * len(views))

    @staticmethod
    def _rank_views(tensors: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """First ``rank`` ranks of max-rank tensors in ``keys`` order (A rows, B columns alternate)."""
        return [t[:rank] if i % 2 == 0 else t[:, :rank] for i, t in enumerate(tensors)]

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def _record(self) -> torch.cuda.Event | None:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    # ---- tenants ------------------------------------------------------------------------------------
    def register(self, name: str, weights: AdapterWeights, schedule: LRSchedule, seed: int,
                 algorithm: AlgorithmConfig | None = None, weight_decay: float | None = None,
                 max_grad_norm: float | None = None) -> None:
        """Adds a tenant whose adapter starts at ``weights`` (fp32, PEFT layout), with its own SkyRL ``algorithm``
        settings, AdamW ``weight_decay`` and gradient clipping ``max_grad_norm`` when given (None: the trainer's)."""
        if name in self.tenants:
            raise ValueError(f"tenant {name!r} is already registered")
        if weights.rank > self.max_rank:
            raise ValueError(f"tenant {name!r} rank {weights.rank} exceeds sampler.max_lora_rank={self.max_rank}")
        if set(weights.a) != set(self.signature):
            raise ValueError(f"tenant {name!r} adapter targets {sorted(weights.a)[:3]}... differ from the model's LoRA layers")
        for path, (fan_in, fan_out) in self.signature.items():
            if tuple(weights.a[path].shape) != (weights.rank, fan_in) or tuple(weights.b[path].shape) != (fan_out, weights.rank):
                raise ValueError(f"tenant {name!r} adapter shape mismatch at {path}")
        numel = self._numel(weights.rank)
        flat = {table: host_empty(numel, torch.float32, self._pin).zero_() for table in TABLES}
        views = {table: dict(zip(self.keys, self._views(flat[table], weights.rank))) for table in TABLES}
        for path in self.signature:
            views["master"][f"{path}.a"].copy_(weights.a[path])
            views["master"][f"{path}.b"].copy_(weights.b[path])
        generator = torch.Generator().manual_seed(seed)
        state = TenantState(
            name=name, rank=weights.rank, alpha=weights.alpha, schedule=schedule,
            weights=AdapterWeights(rank=weights.rank, alpha=weights.alpha), flat=flat, **views,
            rng_state=generator.get_state(), algorithm=algorithm, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        host_weights = host_empty(numel, self.dtype, self._pin)
        host_weights.copy_(flat["master"])
        self._set_weights(state, host_weights)
        self.tenants[name] = state

    def restore(self, name: str, tables: dict[str, torch.Tensor], rng_state: torch.Tensor, step: int,
                kl_coef: float | None = None) -> None:
        """Replaces registered tenant ``name``'s host state: ``tables`` (per table of ``TABLES``, the flat fp32
        buffer at the tenant's rank), RNG state, step and KL controller value; its model-dtype weights become the
        masters' cast, as after a swap-out. The tenant must not be on the device."""
        if self.slot_of(name) is not None:
            raise RuntimeError(f"tenant {name!r} is on the device; swap it out first")
        self.wait(name)
        state = self.tenants[name]
        for table in TABLES:
            if tables[table].shape != state.flat[table].shape:
                raise ValueError(f"tenant {name!r}: {table} has {tables[table].numel()} values, the store {state.flat[table].numel()}")
            state.flat[table].copy_(tables[table])
        host_weights = host_empty(state.flat["master"].numel(), self.dtype, self._pin)
        host_weights.copy_(state.flat["master"])
        self._set_weights(state, host_weights)
        state.rng_state = rng_state.clone()
        state.step = step
        state.kl_coef = kl_coef

    def remove(self, name: str) -> None:
        if any(slot.owner == name for slot in self.slots):
            raise ValueError(f"tenant {name!r} is on the device; swap it out first")
        self.wait(name)
        if self._stream is not None:  # a released prefetch may still read its tables, whose blocks are then reused
            self._stream.synchronize()
        del self.tenants[name]

    def slot_of(self, name: str) -> int | None:
        """The slot holding ``name`` (prefetched or swapped in), or None."""
        return next((index for index, slot in enumerate(self.slots) if slot.owner == name), None)

    def wait(self, name: str | None = None) -> None:
        """Blocks until the host state of ``name`` (every tenant when None) is final after a swap-out."""
        for state in [self.tenants[name]] if name is not None else list(self.tenants.values()):
            if state.pending is not None:
                state.pending.synchronize()
                state.pending = None

    # ---- swaps --------------------------------------------------------------------------------------
    def prefetch(self, name: str, slot_index: int) -> None:
        """Step 1 of the swap algorithm: starts copying ``name``'s host state into ``slot_index``."""
        state = self.tenants[name]
        slot = self.slots[slot_index]
        if slot.owner is not None:
            raise RuntimeError(f"device slot {slot_index} still holds {slot.owner!r}")
        if self.slot_of(name) is not None:
            raise RuntimeError(f"tenant {name!r} is already on the device")
        numel = self._numel(state.rank)
        with self._on_side_stream():
            for table in TABLES:
                slot.staging[table][:numel].copy_(state.flat[table], non_blocking=True)
            slot.ready = self._record()
        slot.owner, slot.active = name, False

    def swap_in(self, name: str, slot_index: int) -> TenantState:
        """Step 2 of the swap algorithm (after step 1 unless ``name`` is prefetched into the slot)."""
        slot = self.slots[slot_index]
        if slot.owner != name or slot.active:
            self.prefetch(name, slot_index)
        state = self.tenants[name]
        r = state.rank
        if slot.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
            slot.ready = None
        with torch.no_grad():
            for table in TABLES[:3]:
                if r < self.max_rank:
                    torch._foreach_zero_(self.table_views(slot_index, table))
                torch._foreach_copy_(self.table_views(slot_index, table, r), self.staging_views(slot_index, table, r))
            torch._foreach_zero_(self.param_views(slot_index, grads=True))
            torch._foreach_copy_(self.param_views(slot_index, grads=True, rank=r), self.staging_views(slot_index, "grads", r))
            torch._foreach_copy_(self.param_views(slot_index), self.table_views(slot_index, "master"))
            self._set_scales(slot_index, state.scale)
        slot.active = True
        return state

    def release(self, slot_index: int) -> None:
        """Frees a slot holding a prefetched (never swapped-in) tenant."""
        slot = self.slots[slot_index]
        if slot.active:
            raise RuntimeError(f"device slot {slot_index} holds {slot.owner!r} swapped in; swap it out")
        if slot.ready is not None:  # the staging buffers may be refilled only after this copy is done
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        slot.owner, slot.ready = None, None

    def swap_out(self, slot_index: int) -> TenantState:
        """Step 3 of the swap algorithm; returns the tenant's host state (final after :meth:`wait`)."""
        slot = self.slots[slot_index]
        if slot.owner is None or not slot.active:
            raise RuntimeError(f"device slot {slot_index} has no swapped-in tenant")
        state = self.tenants[slot.owner]
        r = state.rank
        numel = self._numel(r)
        with torch.no_grad():
            for table in TABLES[:3]:
                torch._foreach_copy_(self.staging_views(slot_index, table, r), self.table_views(slot_index, table, r))
            torch._foreach_copy_(self.staging_views(slot_index, "grads", r), self.param_views(slot_index, grads=True, rank=r))
            slot.staging["weights"][:numel].copy_(slot.staging["master"][:numel])
            self._set_scales(slot_index, 0.0)
        packed = self._record()
        host_weights = host_empty(numel, self.dtype, self._pin)
        with self._on_side_stream():
            if packed is not None:
                torch.cuda.current_stream(self.device).wait_event(packed)
            for table in TABLES:
                state.flat[table].copy_(slot.staging[table][:numel], non_blocking=True)
            host_weights.copy_(slot.staging["weights"][:numel], non_blocking=True)
            state.pending = self._record()
        self._set_weights(state, host_weights)
        slot.owner, slot.active = None, False
        return state

    def _set_weights(self, state: TenantState, flat: torch.Tensor) -> None:
        """Points the tenant's model-dtype weights (a fresh object: earlier ones stay valid) at ``flat``."""
        weights = AdapterWeights(rank=state.rank, alpha=state.alpha)
        views = self._views(flat, state.rank)
        for index, path in enumerate(self.signature):
            weights.a[path], weights.b[path] = views[2 * index], views[2 * index + 1]
        state.weights = weights
