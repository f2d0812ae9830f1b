"""The sampler's adapters: every registered adapter's latest published version in host memory, and the bounded set
of device LoRA slots (``layers[*].lora_a: [S, R, H_in]``) that hold some of them, a cache filled on demand with the
least recently used adapter out. The single owner of a tenant's published version: the sync and the clients read it
here.

Invariant: a resident adapter's slot holds its latest published version once the engine has loaded it (a load and a
publish both write the host copy into the slot), so a request admitted under version ``v`` is sampled with ``v``
whether its adapter stayed resident or was evicted and loaded again.

Threads: :meth:`AdapterSlots.register`, :meth:`~AdapterSlots.version`, ``in`` and :meth:`~AdapterSlots.host_copy` may
be called from any thread; everything else runs on the engine thread, the residency decisions (:meth:`assign`,
:meth:`touch`, :meth:`evictable`) by the scheduler and the device writes (:meth:`publish`, :meth:`load`,
:meth:`clear`) by the engine, between two decode steps.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear, read_slot, write_slot
from skyrl_clora.device.pinned_memory import InFlight, host_copies


class AdapterSlots:
    """Name -> latest published (host weights, version), and name -> device slot for the resident ones, over
    ``layers``' ``count`` slots. ``pin``: host copies live in pinned memory (a CUDA engine's loads then copy
    asynchronously in stream order)."""

    def __init__(self, layers: dict[str, MultiLoRALinear], pin: bool) -> None:
        self.layers = layers
        self.pin = pin
        self.count = next(iter(layers.values())).lora_a.shape[0]
        self._registered: set[str] = set()
        self._lock = threading.Lock()  # guards _registered against readers on other threads
        self._latest: dict[str, tuple[AdapterWeights, int]] = {}
        self._resident: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(self.count))
        self._in_flight = InFlight()  # host copies whose writes into slots may still be queued (pin)

    def __contains__(self, name: object) -> bool:
        return name in self._registered

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._registered)

    def register(self, name: str) -> None:
        """Registers ``name`` (no version until its first :meth:`publish`; no slot until a request needs one).
        Raises ValueError when it is registered already."""
        with self._lock:
            if name in self._registered:
                raise ValueError(f"adapter {name!r} is already registered")
            self._registered.add(name)

    def host_copy(self, weights: AdapterWeights) -> AdapterWeights:
        """``weights`` as the host copy :meth:`publish` keeps: when every tensor is in host memory already (pinned,
        with ``pin``) they are kept by reference, so they must not change after the publish (the trainer hands out a
        fresh buffer per step); else all are copied into one new host block (page-locked with ``pin``:
        :func:`host_copies`). Any thread."""
        tensors = [*weights.a.values(), *weights.b.values()]
        if not all(tensor.device.type == "cpu" and (not self.pin or tensor.is_pinned()) for tensor in tensors):
            tensors = host_copies(tensors, self.pin)
        copy = AdapterWeights(rank=weights.rank, alpha=weights.alpha)
        copy.a = dict(zip(weights.a, tensors[: len(weights.a)]))
        copy.b = dict(zip(weights.b, tensors[len(weights.a) :]))
        return copy

    def version(self, name: str) -> int:
        """``name``'s latest published version (KeyError before its first publish or after it is cleared)."""
        return self._latest[name][1]

    def resident(self, name: str) -> bool:
        """Whether ``name`` holds a device slot."""
        return name in self._resident

    def slot(self, name: str) -> int:
        """``name``'s device slot (KeyError when it is not resident)."""
        return self._resident[name]

    def evictable(self, busy: set[str | None]) -> list[str]:
        """The resident adapters not in ``busy`` (those with requests running or being prefilled), least recently
        used first: the ones whose slot :meth:`assign` may take."""
        return [name for name in self._resident if name not in busy]

    def free(self) -> int:
        """How many slots hold no adapter."""
        return len(self._free)

    def available(self, busy: set[str | None]) -> int:
        """How many slots :meth:`assign` could give now: the free ones and those of :meth:`evictable` adapters."""
        return len(self._free) + len(self.evictable(busy))

    def lru(self) -> list[str]:
        """The resident adapters, least recently used first."""
        return list(self._resident)

    def touch(self, name: str) -> None:
        """``name`` (resident) was just used: it becomes the most recently used."""
        self._resident.move_to_end(name)

    def assign(self, name: str, busy: set[str | None], queued: set[str | None] = frozenset()) -> str | None:
        """Gives ``name`` (registered, not resident) a device slot: a free one, else the slot of an :meth:`evictable`
        adapter, which stops being resident: the least recently used of those not in ``queued`` (adapters with
        requests waiting, which would need loading again), else of all. Returns the evicted adapter (None for a free
        slot). The slot holds ``name`` once the engine has :meth:`load`-ed it. Raises ValueError when every slot is
        held by a busy adapter."""
        if self._free:
            self._resident[name] = self._free.pop(0)
            return None
        candidates = self.evictable(busy)
        if not candidates:
            raise ValueError(f"all {self.count} adapter slots hold adapters with running requests")
        evicted = next((candidate for candidate in candidates if candidate not in queued), candidates[0])
        self._resident[name] = self._resident.pop(evicted)
        return evicted

    def evict(self, name: str) -> None:
        """Frees ``name``'s slot (its contents are left; the next adapter given the slot is loaded over them)."""
        self._free.append(self._resident.pop(name))
        self._free.sort()

    def load(self, name: str) -> None:
        """Writes ``name``'s latest published host copy into its slot in place (``write_slot``); with ``pin`` the copy
        is kept alive until that asynchronous write is done, whatever is published meanwhile."""
        weights = self._latest[name][0]
        write_slot(self.layers, self._resident[name], weights)
        if self.pin:
            self._in_flight.hold(weights)

    def publish(self, name: str, weights: AdapterWeights, version: int) -> None:
        """Makes ``weights`` (a :meth:`host_copy`) ``name``'s latest version ``version``, and writes it into its slot
        when it is resident (no running request may use that slot: the scheduler's version fence)."""
        if name not in self._registered:
            raise ValueError(f"unknown adapter {name!r}")
        self._latest[name] = (weights, version)
        if name in self._resident:
            self.load(name)

    def clear(self, name: str) -> None:
        """Unregisters ``name``: its host copy is dropped and its slot, if it holds one, emptied and freed."""
        with self._lock:
            self._registered.discard(name)
        self._latest.pop(name, None)
        if name in self._resident:
            write_slot(self.layers, self._resident[name], None)
            self.evict(name)

    def read(self, name: str, rank: int, alpha: float) -> AdapterWeights:
        """A copy of the first ``rank`` ranks of the adapter the sampler serves as ``name``: its slot's contents when
        resident, else its host copy."""
        if name in self._resident:
            return read_slot(self.layers, self._resident[name], rank, alpha)
        weights = self._latest[name][0]
        served = AdapterWeights(rank=rank, alpha=alpha)
        served.a = {path: tensor[:rank].clone() for path, tensor in weights.a.items()}
        served.b = {path: tensor[:, :rank].clone() for path, tensor in weights.b.items()}
        return served
