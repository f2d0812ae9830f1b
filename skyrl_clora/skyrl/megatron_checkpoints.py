"""Per-tenant checkpoints on SkyRL's Megatron policy worker, over SkyRL 0.4's own ``AdapterStore``.

:func:`with_megatron_tenant_checkpoints` derives a worker class (SkyRL's ``MegatronPolicyWorkerBase`` with
:class:`~skyrl_clora.skyrl.megatron_seeding.SeededTenantAdaptersMixin`) that adds what the driver calls
(``save_tenant_state`` / ``load_tenant_state``, ``pass_through`` to every rank) and what a tenant's checkpoint
needs beyond SkyRL's store:

- the store's slot of the tenant (``AdapterStore._slots[model_id]``, an ``AdapterSlot``), which is everything
  SkyRL swaps per adapter: the LoRA DDP buffers' ``param_data`` and ``grad_data`` (per model chunk and buffer),
  the distributed optimizer's fp32 main-parameter shards (``shard_fp32_from_float16_groups``), their optimizer
  state (Adam moments and any ``step``: tensors and Python scalars) and each param group's scalars (``lr``,
  ``weight_decay``, TE FusedAdam's ``step``, ...). A live tenant is snapshotted into its slot first
  (``AdapterStore._snapshot``); a loaded live tenant is restored from it (``AdapterStore._restore``);
- its optimizer steps: counted per tenant at each ``optim_step`` (the driver's LR schedule position: it sends
  the scheduled LR with ``set_lr`` before every step, as SkyRL's Tinker backend does, so Megatron's shared
  ``OptimizerParamScheduler`` holds no tenant state);
- its RNG: SkyRL's store swaps no RNG, so the mixin does, around ``swap_to_adapter``: the torch CPU generator,
  and on CUDA the device generator and Megatron's CUDA RNG tracker states. A tenant starts from its seed
  (``set_adapter_seeds``; an id without one, e.g. the KL reference, continues the live RNG).

Checkpoint layout (``folder`` must be reachable from every rank; the caller renames it into place):
``megatron_tenant_state.json`` (rank 0: the store's ``LoraSignature``, world size, steps) and per rank ``r``
``megatron_tenant_state.rank<r>.safetensors`` (``param_data.<mc>.<buf>``, ``grad_data.<mc>.<buf>``,
``main_param.<opt>.<g>.<i>``, ``opt_state.<opt>.<g>.<i>.<key>``, ``group_state.<opt>.<pg>.<key>`` for tensor
entries, ``rng.<name>``) with ``megatron_tenant_state.rank<r>.json`` (the non-tensor scalars, nested as the
slot nests them). A checkpoint loads only into a worker of the same signature, world size and slot layout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from skyrl_clora.skyrl.megatron_seeding import SeededTenantAdaptersMixin

STATE_META = "megatron_tenant_state.json"
RNG_PREFIX = "rng."


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _rank_files(rank: int) -> tuple[str, str]:
    return f"megatron_tenant_state.rank{rank}.safetensors", f"megatron_tenant_state.rank{rank}.json"


def _sync_device() -> None:
    """Waits for the store's ``non_blocking`` copies (the store's own public calls do the same)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


# ---- RNG ---------------------------------------------------------------------------------------------

def capture_rng() -> dict[str, torch.Tensor]:
    """The live RNG: ``cpu`` (torch's generator) and, on CUDA, ``cuda`` and ``tracker.<name>`` (Megatron's CUDA
    RNG tracker, which holds CUDA generator states only)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state.update({f"tracker.{name}": value.clone() for name, value in get_cuda_rng_tracker().get_states().items()})
    return state


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    """Makes ``state`` (from :func:`capture_rng` or :func:`seeded_rng`) the live RNG."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states({key.removeprefix("tracker."): value for key, value in state.items()
                                           if key.startswith("tracker.")})


def seeded_rng(seed: int) -> dict[str, torch.Tensor]:
    """A tenant's first RNG: torch's generators seeded with ``seed`` (Megatron's tracker: the live states, which
    Megatron seeded from the run's seed and this rank's model-parallel coordinates)."""
    state = capture_rng()
    state["cpu"] = torch.Generator().manual_seed(seed).get_state()
    if "cuda" in state:
        device = torch.device("cuda", torch.cuda.current_device())
        state["cuda"] = torch.Generator(device=device).manual_seed(seed).get_state()
    return state


# ---- the store's slot, flattened -----------------------------------------------------------------------

def slot_tensors(slot: Any) -> dict[str, torch.Tensor]:
    """Every tensor of an ``AdapterSlot`` (SkyRL's ``workers/megatron/adapter_store.py``) by checkpoint key; the
    slot's own tensors (writing into them writes the slot)."""
    tensors: dict[str, torch.Tensor] = {}
    for kind, nested in (("param_data", slot.cpu_param_data), ("grad_data", slot.cpu_grad_data)):
        for mc, buffers in enumerate(nested):
            for buf, tensor in enumerate(buffers):
                tensors[f"{kind}.{mc}.{buf}"] = tensor
    for opt, groups in enumerate(slot.cpu_main_param):
        for g, group in enumerate(groups):
            for i, tensor in enumerate(group):
                tensors[f"main_param.{opt}.{g}.{i}"] = tensor
    for opt, groups in enumerate(slot.cpu_opt_state):
        for g, group in enumerate(groups):
            for i, state in enumerate(group):
                tensors.update({f"opt_state.{opt}.{g}.{i}.{key}": value for key, value in state.items()
                                if isinstance(value, torch.Tensor)})
    for opt, groups in enumerate(slot.cpu_param_group_state):
        for pg, state in enumerate(groups):
            tensors.update({f"group_state.{opt}.{pg}.{key}": value for key, value in state.items()
                            if isinstance(value, torch.Tensor)})
    return tensors


def slot_scalars(slot: Any) -> dict[str, Any]:
    """The non-tensor entries of the slot's optimizer state (``[opt][g][i]``) and param-group state
    (``[opt][pg]``), nested as the slot nests them (Python ints, floats and bools: exact through JSON)."""

    def scalars(state: dict) -> dict:
        return {key: value for key, value in state.items() if not isinstance(value, torch.Tensor)}

    return {"opt_state": [[[scalars(s) for s in group] for group in groups] for groups in slot.cpu_opt_state],
            "group_state": [[scalars(s) for s in groups] for groups in slot.cpu_param_group_state]}


def write_slot(slot: Any, rng: dict[str, torch.Tensor], folder: Path) -> None:
    """Writes this rank's ``slot`` and ``rng`` into ``folder`` (module docstring)."""
    tensors_file, scalars_file = _rank_files(_world()[0])
    tensors = {**slot_tensors(slot), **{RNG_PREFIX + name: value for name, value in rng.items()}}
    save_file({key: value.detach().cpu().contiguous() for key, value in tensors.items()}, str(folder / tensors_file))
    (folder / scalars_file).write_text(json.dumps(slot_scalars(slot), sort_keys=True) + "\n")


@torch.no_grad()
def read_slot(slot: Any, folder: Path, model_id: str) -> dict[str, torch.Tensor]:
    """Copies this rank's checkpoint in ``folder`` into ``slot`` (in place); its RNG. A ValueError names what does
    not match (nothing is written into the slot then)."""
    tensors_file, scalars_file = _rank_files(_world()[0])
    if not (folder / tensors_file).is_file() or not (folder / scalars_file).is_file():
        raise ValueError(f"tenant {model_id!r}: {folder} holds no Megatron tenant state for rank {_world()[0]}")
    saved = load_file(str(folder / tensors_file))
    scalars = json.loads((folder / scalars_file).read_text())
    mine = slot_tensors(slot)
    rng = {key.removeprefix(RNG_PREFIX): value for key, value in saved.items() if key.startswith(RNG_PREFIX)}
    saved = {key: value for key, value in saved.items() if not key.startswith(RNG_PREFIX)}
    differing = sorted(key for key in mine.keys() | saved.keys() if key not in mine or key not in saved
                       or mine[key].shape != saved[key].shape or mine[key].dtype != saved[key].dtype)
    layout = slot_scalars(slot)
    same_scalars = (json.dumps(_keys(scalars)) == json.dumps(_keys(layout)))
    if differing or not same_scalars or set(rng) != set(capture_rng()):
        what = ", ".join(differing[:4]) or ("optimizer scalars" if not same_scalars else "RNG (CPU vs CUDA worker)")
        raise ValueError(f"tenant {model_id!r}: the checkpoint in {folder} does not match this worker's adapter "
                         f"slot ({what}); it loads only into a worker of the same model, LoRA and parallelism")
    for key, tensor in mine.items():
        tensor.copy_(saved[key])
    for opt, groups in enumerate(scalars["opt_state"]):
        for g, group in enumerate(groups):
            for i, state in enumerate(group):
                slot.cpu_opt_state[opt][g][i].update(state)
    for opt, groups in enumerate(scalars["group_state"]):
        for pg, state in enumerate(groups):
            slot.cpu_param_group_state[opt][pg].update(state)
    return rng


def _keys(nested: Any) -> Any:
    """``nested`` with each dict replaced by its sorted keys (the layout, without the values)."""
    if isinstance(nested, dict):
        return sorted(nested)
    return [_keys(item) for item in nested] if isinstance(nested, list) else nested


class MegatronTenantCheckpointsMixin(SeededTenantAdaptersMixin):
    """Tenant checkpoints, step counts and RNG on SkyRL's Megatron policy worker (module docstring). Put in front
    of the worker class with :func:`with_megatron_tenant_checkpoints`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clora_steps: dict[str, int] = {}
        self._clora_rng: dict[str, dict[str, torch.Tensor]] = {}  # parked tenants' RNG (the live one's is live)

    # ---- the adapter-store API, with each tenant's steps and RNG ------------------------------------------

    def register_adapter(self, model_id: str) -> None:
        super().register_adapter(model_id)
        self._clora_steps[model_id] = 0
        seed = self._clora_adapter_seeds.get(model_id)
        rng = seeded_rng(seed) if seed is not None else capture_rng()
        if self._adapter_store().current_id == model_id:
            restore_rng(rng)
        else:
            self._clora_rng[model_id] = rng

    def delete_adapter(self, model_id: str) -> None:
        super().delete_adapter(model_id)  # type: ignore[misc]
        self._clora_steps.pop(model_id, None)
        self._clora_rng.pop(model_id, None)

    def swap_to_adapter(self, model_id: str) -> None:
        """SkyRL's swap, with the RNG parked for the outgoing tenant and restored for the incoming one."""
        current = self._adapter_store().current_id
        if current is not None and current != model_id:
            self._clora_rng[current] = capture_rng()
        super().swap_to_adapter(model_id)  # type: ignore[misc]
        parked = self._clora_rng.pop(model_id, None) if current != model_id else None
        if parked is not None:
            restore_rng(parked)

    def optim_step(self) -> Any:
        """SkyRL's ``optim_step`` on the live tenant; counts the step for it."""
        current = self._adapter_store().current_id
        result = super().optim_step()  # type: ignore[misc]
        if current is not None:
            self._clora_steps[current] += 1
        return result

    # ---- checkpoints ----------------------------------------------------------------------------------

    def save_tenant_state(self, model_id: str, folder: str) -> None:
        """Writes ``model_id``'s state (its live state first, when it is live) into ``folder``, every rank."""
        store, slot = self._adapter_store(), self._slot(model_id)
        live = store.current_id == model_id
        if live:
            store._snapshot(slot, self.actor_module, self.optimizer)  # type: ignore[attr-defined]
            _sync_device()
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        write_slot(slot, capture_rng() if live else self._clora_rng[model_id], path)
        rank, world = _world()
        if rank == 0:
            meta = {"signature": _signature_json(store.signature), "world_size": world,
                    "steps": self._clora_steps[model_id]}
            (path / STATE_META).write_text(json.dumps(meta, sort_keys=True) + "\n")
        if dist.is_initialized():
            dist.barrier()

    def load_tenant_state(self, model_id: str, folder: str) -> int:
        """Replaces ``model_id``'s state with ``folder``'s (live too, when it is live); its optimizer steps."""
        store, slot = self._adapter_store(), self._slot(model_id)
        path = Path(folder)
        if not (path / STATE_META).is_file():
            raise ValueError(f"tenant {model_id!r}: {path} holds no Megatron tenant state ({STATE_META})")
        meta = json.loads((path / STATE_META).read_text())
        mine = {"signature": _signature_json(store.signature), "world_size": _world()[1]}
        differing = [key for key in mine if meta.get(key) != mine[key]]
        if differing:
            raise ValueError(f"tenant {model_id!r}: the checkpoint in {path} has another {', '.join(differing)} "
                             f"({ {key: meta.get(key) for key in differing} }, this worker: "
                             f"{ {key: mine[key] for key in differing} })")
        rng = read_slot(slot, path, model_id)
        if store.current_id == model_id:
            store._restore(slot, self.actor_module, self.optimizer)  # type: ignore[attr-defined]
            _sync_device()
            restore_rng(rng)
        else:
            self._clora_rng[model_id] = rng
        self._clora_steps[model_id] = int(meta["steps"])
        if dist.is_initialized():
            dist.barrier()
        return self._clora_steps[model_id]

    # ---- helpers ----------------------------------------------------------------------------------------

    def _adapter_store(self) -> Any:
        store = self.adapter_store  # type: ignore[attr-defined]
        if store is None:
            raise RuntimeError("the worker has no AdapterStore: tenants need trainer.policy.model.lora.rank >= 1")
        return store

    def _slot(self, model_id: str) -> Any:
        slot = self._adapter_store()._slots.get(model_id)
        if slot is None:
            raise ValueError(f"adapter {model_id!r} is not registered")
        return slot


def _signature_json(signature: Any) -> dict[str, Any]:
    """SkyRL's ``LoraSignature`` (a frozen dataclass) as JSON values (tuples as lists)."""
    if signature is None:
        raise RuntimeError("the AdapterStore has no signature: call register_pristine_adapter first")
    return json.loads(json.dumps(dataclasses.asdict(signature)))


def with_megatron_tenant_checkpoints(worker_cls: type) -> type:
    """``worker_cls`` (SkyRL's Megatron policy worker class, possibly derived, without the seeding mixin: this
    mixin brings it) with :class:`MegatronTenantCheckpointsMixin` in front."""
    for name in ("register_adapter", "delete_adapter", "swap_to_adapter", "optim_step"):
        if not callable(getattr(worker_cls, name, None)):
            raise TypeError(f"{worker_cls.__name__} has no {name}; the installed SkyRL has no Megatron AdapterStore")
    if issubclass(worker_cls, SeededTenantAdaptersMixin):
        raise TypeError(f"{worker_cls.__name__} already has SeededTenantAdaptersMixin; "
                        "with_megatron_tenant_checkpoints brings it")
    return type(f"Tenant{worker_cls.__name__}", (MegatronTenantCheckpointsMixin, worker_cls), {})
