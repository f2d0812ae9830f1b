"""A tenant's training state on disk: what a checkpoint needs to continue the tenant bit for bit.

``write_tenant_state`` saves an :class:`~skyrl_clora.trainer.adapter_store.TenantState` (its host tables: fp32
master weights, Adam moments and last gradients, one flat buffer each at the tenant's rank; the RNG state;
the optimizer step; its reward KL controller's value, exactly as a JSON float) into
``<folder>/trainer_state.safetensors`` and ``<folder>/trainer_state.json``;
``read_tenant_state`` puts them back into a registered tenant of the same rank, alpha and layer signature (a
mismatch is a ValueError naming it) through ``AdapterStore.restore``. The tenant must not be on the device.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from skyrl_clora.trainer.adapter_store import TABLES, AdapterStore

TENSORS = "trainer_state.safetensors"
META = "trainer_state.json"


def write_tenant_state(store: AdapterStore, name: str, folder: Path) -> None:
    """Writes tenant ``name``'s host state into ``folder`` (which must exist)."""
    if store.slot_of(name) is not None:
        raise RuntimeError(f"tenant {name!r} is on the device; its host state is not final")
    store.wait(name)
    state = store.tenants[name]
    tensors = {table: state.flat[table] for table in TABLES} | {"rng_state": state.rng_state}
    save_file({key: value.detach().cpu().contiguous() for key, value in tensors.items()}, str(folder / TENSORS))
    meta = {"step": state.step, "rank": state.rank, "alpha": state.alpha, "signature": _signature(store),
            "kl_coef": state.kl_coef}
    (folder / META).write_text(json.dumps(meta, sort_keys=True) + "\n")


def read_tenant_state(store: AdapterStore, name: str, folder: Path) -> None:
    """Replaces registered tenant ``name``'s host state with the one ``folder`` holds."""
    state = store.tenants[name]
    meta = json.loads((folder / META).read_text())
    mine = {"rank": state.rank, "alpha": state.alpha, "signature": _signature(store)}
    differing = [key for key, value in mine.items() if meta[key] != value]
    if differing:
        raise ValueError(f"tenant {name!r}: the checkpoint in {folder} has another {', '.join(differing)}")
    tensors = load_file(str(folder / TENSORS))
    store.restore(name, {table: tensors[table] for table in TABLES}, tensors["rng_state"], int(meta["step"]),
                  meta.get("kl_coef"))


def _signature(store: AdapterStore) -> dict[str, list[int]]:
    return {path: list(shape) for path, shape in store.signature.items()}
