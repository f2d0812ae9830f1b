"""The sampler's adapter slots: which LoRA slot of the engine's layers holds each adapter, and the version of it
that the slot holds. The single owner of a tenant's published version: the sync and the clients read it here.

Slots are reserved from any thread (before the adapter's first request); contents and versions are written on
the engine thread, between two decode steps (``write`` / ``clear``).
"""

from __future__ import annotations

from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear, read_slot, write_slot


class AdapterSlots:
    """Name -> (slot, published version) over ``layers``' slots (``layers[*].lora_a``: ``[S, R, H_in]``)."""

    def __init__(self, layers: dict[str, MultiLoRALinear]) -> None:
        self.layers = layers
        self.count = next(iter(layers.values())).lora_a.shape[0]
        self._slots: dict[str, int] = {}
        self._versions: dict[str, int] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def names(self) -> list[str]:
        return sorted(self._slots)

    def reserve(self, name: str) -> int:
        """Gives ``name`` the lowest free slot (empty until its first ``write``); returns it."""
        if name in self._slots:
            raise ValueError(f"adapter {name!r} is already registered")
        used = set(self._slots.values())
        free = [slot for slot in range(self.count) if slot not in used]
        if not free:
            raise ValueError(f"all {self.count} adapter slots are in use; raise clora.max_tenants")
        self._slots[name] = free[0]
        return free[0]

    def slot(self, name: str) -> int:
        return self._slots[name]

    def version(self, name: str) -> int:
        """The version ``name``'s slot holds (KeyError before its first write or after it is cleared)."""
        return self._versions[name]

    def write(self, name: str, weights: AdapterWeights, version: int) -> None:
        """Copies ``weights`` into ``name``'s slot in place (``write_slot``) and records ``version``."""
        write_slot(self.layers, self._slots[name], weights)
        self._versions[name] = version

    def clear(self, name: str) -> None:
        """Empties ``name``'s slot and frees it."""
        write_slot(self.layers, self._slots.pop(name), None)
        self._versions.pop(name, None)

    def read(self, name: str, rank: int, alpha: float) -> AdapterWeights:
        """A copy of the first ``rank`` ranks of ``name``'s slot: the adapter the sampler serves."""
        return read_slot(self.layers, self._slots[name], rank, alpha)
