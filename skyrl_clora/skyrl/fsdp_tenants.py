"""Tenants on SkyRL's own FSDP2 policy worker: :func:`with_fsdp_tenants` derives a worker class whose
``register_adapter`` / ``delete_adapter`` / ``swap_to_adapter`` (the multi-LoRA API SkyRL's ``WorkerDispatch``
drives with ``model_id``, as on Megatron) run over a :class:`~skyrl_clora.skyrl.fsdp_store.FSDPAdapterStore`.

SkyRL 0.4's ``FSDPPolicyWorkerBase`` raises "supports a single LoRA adapter" for these calls. With the mixin:

====================================  =========================================================================
call (``pass_through`` to every rank)  what the worker does
====================================  =========================================================================
``init_model(path, steps)``           SkyRL's (HF model + PEFT LoRA + ``fully_shard`` + AdamW + scheduler),
                                      then the store over its LoRA parameters
``prime_optimizer_state()``           AdamW's state for every LoRA parameter (zero moments, step 0)
``register_pristine_adapter()``       fixes the LoRA signature and the scheduler new tenants start from
``measure_training_peak(batch)``      one ``forward_backward`` on a throwaway tenant: the GPU's uuid, the
                                      allocator's peak and current reservation (before any tenant exists)
``allocator_stats()``                 the CUDA allocator's retries, cudaMalloc/cudaFree calls and peak
``set_tenant_specs({t: {seed, lr}})`` each tenant's seed (its initial adapter and RNG) and LR (its schedule's
                                      base LR); ids without a spec cannot be registered
``register_adapter(t)``               a slot for ``t`` (``REFERENCE_MODEL_ID``: no state, the base model)
``delete_adapter(t)``                 drops the slot
``swap_to_adapter(t)``                ``t``'s slot live (``REFERENCE_MODEL_ID``: the live adapter disabled)
``forward`` / ``forward_backward`` /  SkyRL's, on the live tenant; ``forward`` under ``REFERENCE_MODEL_ID`` runs
``optim_step``                        with PEFT's adapter disabled (the frozen base: SkyRL's KL reference)
``save_tenant_state(t, folder)``,     a tenant's checkpoint: its slot (live state first) per rank, to or
``load_tenant_state(t, folder)``      from ``folder``; load returns its optimizer steps
``init_weight_sync_state``            keeps the client (the LoRA path loads adapters by folder and needs
                                      no weight-transfer engine)
``broadcast_to_inference_engines``    SkyRL's LoRA path (PEFT folder under ``lora_sync_path/<t>``,
                                      ``load_lora_adapter(t, folder)``) for the live tenant only
====================================  =========================================================================

Checkpoint layout (``folder`` must be reachable from every rank): ``fsdp_tenant_state.json`` (rank 0: signature,
seed, LR, scheduler state, whether gradients are pending) and ``fsdp_tenant_state.rank<r>.safetensors`` (each
rank's local shards: ``param.<i>``, ``exp_avg.<i>``, ``exp_avg_sq.<i>``, ``grad.<i>`` when pending, ``steps``,
``rng_cpu``, ``rng_cuda``). A checkpoint loads only into a worker of the same signature (world size included).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from skyrl_clora.skyrl.fsdp_store import FSDPAdapterStore, FSDPLoraSignature, TenantSlot, lora_a_initializer
from skyrl_clora.skyrl.worker import REFERENCE_MODEL_ID

STATE_META = "fsdp_tenant_state.json"
PEAK_TENANT = "clora-memory-plan"  # the throwaway tenant of measure_training_peak


def _rank_file(rank: int) -> str:
    return f"fsdp_tenant_state.rank{rank}.safetensors"


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def write_slot(slot: TenantSlot, signature: FSDPLoraSignature, folder: Path) -> None:
    """Writes ``slot`` (this rank's shards; rank 0 also the metadata) into ``folder``."""
    rank, _ = _world()
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"steps": slot.steps, "rng_cpu": slot.rng_cpu}
    if slot.rng_cuda is not None:
        tensors["rng_cuda"] = slot.rng_cuda
    for i in range(len(slot.params)):
        tensors[f"param.{i}"], tensors[f"exp_avg.{i}"], tensors[f"exp_avg_sq.{i}"] = (
            slot.params[i], slot.exp_avg[i], slot.exp_avg_sq[i])
        if slot.has_grads:
            tensors[f"grad.{i}"] = slot.grads[i]
    save_file({key: value.detach().cpu().contiguous() for key, value in tensors.items()}, str(folder / _rank_file(rank)))
    if rank == 0:
        meta = {"signature": signature.as_json(), "seed": slot.seed, "lr": slot.lr, "schedule": slot.schedule,
                "has_grads": slot.has_grads}
        (folder / STATE_META).write_text(json.dumps(meta, sort_keys=True) + "\n")


@torch.no_grad()
def read_slot(slot: TenantSlot, signature: FSDPLoraSignature, folder: Path, model_id: str) -> None:
    """Copies the checkpoint in ``folder`` into ``slot``; a ValueError names what does not match."""
    rank, _ = _world()
    if not (folder / STATE_META).is_file() or not (folder / _rank_file(rank)).is_file():
        raise ValueError(f"tenant {model_id!r}: {folder} holds no FSDP tenant state for rank {rank}")
    meta = json.loads((folder / STATE_META).read_text())
    saved, mine = meta["signature"], signature.as_json()
    differing = [key for key in mine if saved.get(key) != mine[key]]
    if differing:
        raise ValueError(f"tenant {model_id!r}: the checkpoint in {folder} has another {', '.join(differing)}")
    tensors = load_file(str(folder / _rank_file(rank)))
    for i in range(len(slot.params)):
        slot.params[i].copy_(tensors[f"param.{i}"])
        slot.exp_avg[i].copy_(tensors[f"exp_avg.{i}"])
        slot.exp_avg_sq[i].copy_(tensors[f"exp_avg_sq.{i}"])
        if meta["has_grads"]:
            slot.grads[i].copy_(tensors[f"grad.{i}"])
    slot.steps.copy_(tensors["steps"])
    slot.rng_cpu = tensors["rng_cpu"]
    slot.rng_cuda = tensors.get("rng_cuda") if slot.rng_cuda is not None else None
    slot.has_grads, slot.seed, slot.lr, slot.schedule = meta["has_grads"], meta["seed"], meta["lr"], meta["schedule"]


class FSDPTenantsMixin:
    """Multi-tenant LoRA on SkyRL's FSDP policy worker (module docstring). Put in front of the worker class."""

    _clora_store: Optional[FSDPAdapterStore] = None
    _clora_specs: dict[str, dict[str, float]] = {}
    _clora_reference: bool = False
    _clora_has_reference: bool = False

    # ---- set-up -----------------------------------------------------------------------------------

    def init_model(self, model_path: str, num_training_steps: Optional[int] = None) -> None:
        """SkyRL's ``init_model``, then the adapter store over the model's LoRA parameters."""
        lora = self.cfg.policy.model.lora  # type: ignore[attr-defined]
        if lora.rank < 1:
            raise ValueError("per-tenant FSDP adapters need trainer.policy.model.lora.rank >= 1")
        lora_a_initializer(lora.init_method, lora.rank)  # refuses an init method it cannot draw, before loading
        if self.cfg.policy.inference_only_init:  # type: ignore[attr-defined]
            raise ValueError("trainer.policy.inference_only_init=true builds no optimizer; tenants need one")
        super().init_model(model_path, num_training_steps)  # type: ignore[misc]
        self._clora_store = FSDPAdapterStore(self.model.model, self.optimizer, self.scheduler)  # type: ignore[attr-defined]

    def _clora_signature(self) -> FSDPLoraSignature:
        lora, store = self.cfg.policy.model.lora, self._store()  # type: ignore[attr-defined]
        targets = lora.target_modules
        return FSDPLoraSignature(
            rank=int(lora.rank), alpha=float(lora.alpha),
            target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
            init_method=lora.init_method, world_size=_world()[1],
            params=tuple((name, tuple(param.shape)) for name, param in zip(store.names, store.params)))

    def prime_optimizer_state(self) -> None:
        self._store().prime()

    def register_pristine_adapter(self) -> None:
        self._store().register_pristine(self._clora_signature())

    def set_tenant_specs(self, specs: dict[str, dict[str, float]]) -> None:
        """Each tenant's ``{"seed", "lr"}`` (from its translated SkyRL config)."""
        self._clora_specs = {name: {"seed": int(spec["seed"]), "lr": float(spec["lr"])} for name, spec in specs.items()}

    def measure_training_peak(self, data: Any) -> dict[str, Any]:
        """One SkyRL ``forward_backward`` of ``data`` on a throwaway tenant (created, trained without an optimizer
        step, its gradients dropped, deleted), before any tenant is registered: this GPU's uuid and the allocator's
        peak and current reservation in bytes (the cache is kept), for an engine sharing the GPU to plan around."""
        store = self._store()
        if store.slots:
            raise RuntimeError(f"measure_training_peak runs before tenants are registered; {sorted(store.slots)} are")
        device = torch.cuda.current_device()
        store.create(PEAK_TENANT, 0, 1e-6, self._clora_signature())
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            store.swap_to(PEAK_TENANT)
            super().forward_backward(data)  # type: ignore[misc]
            torch.cuda.synchronize(device)
        finally:
            for param in store.params:
                param.grad = None
            store.delete(PEAK_TENANT)
        return {"uuid": str(torch.cuda.get_device_properties(device).uuid),
                "peak_reserved": torch.cuda.max_memory_reserved(device), "reserved": torch.cuda.memory_reserved(device)}

    def allocator_stats(self) -> dict[str, int]:
        """This worker's CUDA caching allocator since it started: ``alloc_retries`` (allocations that found no free
        block, emptied the cache and asked the driver again: each one synchronizes the device), ``device_mallocs`` and
        ``device_frees`` (cudaMalloc / cudaFree calls), ``peak_reserved`` (bytes)."""
        stats = torch.cuda.memory_stats()
        return {"alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "device_mallocs": int(stats.get("num_device_alloc", 0)),
                "device_frees": int(stats.get("num_device_free", 0)),
                "peak_reserved": int(torch.cuda.max_memory_reserved())}

    # ---- the adapter-store API --------------------------------------------------------------------

    def register_adapter(self, model_id: str) -> None:
        if model_id == REFERENCE_MODEL_ID:
            self._clora_has_reference = True
            return
        spec = self._clora_specs.get(model_id)
        if spec is None:
            raise ValueError(f"unknown tenant {model_id!r}; set_tenant_specs was given {sorted(self._clora_specs)}")
        self._store().create(model_id, spec["seed"], spec["lr"], self._clora_signature())

    def delete_adapter(self, model_id: str) -> None:
        if model_id == REFERENCE_MODEL_ID:
            self._clora_has_reference = self._clora_reference = False
            return
        self._store().delete(model_id)

    def swap_to_adapter(self, model_id: str) -> None:
        if model_id == REFERENCE_MODEL_ID:
            if not self._clora_has_reference:
                raise ValueError(f"adapter {model_id!r} is not registered; call register_adapter first")
            self._clora_reference = True
            return
        self._store().swap_to(model_id)
        self._clora_reference = False

    def adapter_store_state(self) -> dict[str, Any]:
        """SkyRL's Megatron worker's schema (``enabled``, ``current_id``, ``registered``, ``num_adapters``), plus
        ``steps``: each tenant's optimizer steps."""
        store = self._store()
        registered = sorted(store.slots)
        return {"enabled": True, "current_id": REFERENCE_MODEL_ID if self._clora_reference else store.current_id,
                "registered": registered, "num_adapters": len(registered),
                "steps": {name: store.tenant_step(name) for name in registered}}

    def save_tenant_state(self, model_id: str, folder: str) -> None:
        """Writes ``model_id``'s state (the live state first, when it is live) into ``folder``."""
        store = self._store()
        slot = self._slot(model_id)
        if store.current_id == model_id:
            store.snapshot(slot)
        write_slot(slot, store.signature, Path(folder))
        if dist.is_initialized():
            dist.barrier()

    def load_tenant_state(self, model_id: str, folder: str) -> int:
        """Replaces ``model_id``'s state with ``folder``'s (live too, when it is live); its optimizer steps."""
        store = self._store()
        slot = self._slot(model_id)
        read_slot(slot, store.signature, Path(folder), model_id)
        if store.current_id == model_id:
            store.restore(slot)
        if dist.is_initialized():
            dist.barrier()
        return store.tenant_step(model_id)

    # ---- training on the live tenant --------------------------------------------------------------

    def forward(self, data: Any, loss_fn: Optional[str] = None, loss_fn_config: Optional[dict] = None,
                return_per_token_outputs: bool = True) -> Any:
        """SkyRL's forward under the live tenant, or with the adapter disabled under ``REFERENCE_MODEL_ID``."""
        context = self.model.model.disable_adapter() if self._clora_reference else contextlib.nullcontext()  # type: ignore[attr-defined]
        if not self._clora_reference:
            self._live_tenant()
        with context:
            return super().forward(data, loss_fn=loss_fn, loss_fn_config=loss_fn_config,  # type: ignore[misc]
                                   return_per_token_outputs=return_per_token_outputs)

    def forward_backward(self, data: Any, loss_fn: Optional[str] = None, loss_fn_config: Optional[dict] = None,
                         return_per_token_outputs: bool = True) -> Any:
        self._trained_tenant()
        return super().forward_backward(data, loss_fn=loss_fn, loss_fn_config=loss_fn_config,  # type: ignore[misc]
                                        return_per_token_outputs=return_per_token_outputs)

    def optim_step(self) -> Optional[float]:
        self._trained_tenant()
        return super().optim_step()  # type: ignore[misc]

    # ---- weight sync ------------------------------------------------------------------------------

    async def init_weight_sync_state(self, inference_engine_client: Any, inference_engine_cfg: Any) -> None:
        """Keeps the client for the LoRA syncs: SkyRL's LoRA branch of ``broadcast_to_inference_engines`` writes a
        PEFT folder and calls ``load_lora_adapter``; the weight-transfer engine SkyRL's ``init_weight_sync_state``
        builds serves full-weight syncs only (and needs vLLM's transfer endpoints)."""
        if self.cfg.policy.model.lora.sync_mode != "disk":  # type: ignore[attr-defined]
            raise ValueError("per-tenant FSDP adapters sync through disk: set trainer.policy.model.lora.sync_mode=disk")
        self._weight_sync_inference_client = inference_engine_client
        if dist.is_initialized():
            dist.barrier()

    async def broadcast_to_inference_engines(self, inference_engine_client: Any, inference_engine_cfg: Any,
                                             model_id: Optional[str] = None, **kwargs: Any) -> Any:
        """SkyRL's LoRA sync of the live tenant ``model_id`` (``WorkerDispatch`` swaps it in first)."""
        if model_id is None or model_id != self._store().current_id or self._clora_reference:
            raise ValueError(f"sync of {model_id!r} while {self._store().current_id!r} is live; WorkerDispatch swaps "
                             "the tenant in first (and the reference policy is never synced)")
        return await super().broadcast_to_inference_engines(  # type: ignore[misc]
            inference_engine_client, inference_engine_cfg, model_id=model_id, **kwargs)

    # ---- helpers ----------------------------------------------------------------------------------

    def _store(self) -> FSDPAdapterStore:
        if self._clora_store is None:
            raise RuntimeError("the worker's model is not initialised; call init_model first")
        return self._clora_store

    def _slot(self, model_id: str) -> TenantSlot:
        slot = self._store().slots.get(model_id)
        if slot is None:
            raise ValueError(f"adapter {model_id!r} is not registered")
        return slot

    def _live_tenant(self) -> str:
        current = self._store().current_id
        if current is None:
            raise RuntimeError("no live adapter: pass model_id to WorkerDispatch so it swaps one in")
        return current

    def _trained_tenant(self) -> str:
        if self._clora_reference:
            raise ValueError(f"{REFERENCE_MODEL_ID} is the frozen reference policy; it is never trained")
        return self._live_tenant()


def with_fsdp_tenants(worker_cls: type) -> type:
    """``worker_cls`` (SkyRL's FSDP policy worker class, possibly already derived) with :class:`FSDPTenantsMixin`
    in front."""
    for name in ("init_model", "forward", "forward_backward", "optim_step", "broadcast_to_inference_engines"):
        if not callable(getattr(worker_cls, name, None)):
            raise TypeError(f"{worker_cls.__name__} has no {name}; the installed SkyRL has no FSDP policy worker")
    return type(f"Tenant{worker_cls.__name__}", (FSDPTenantsMixin, worker_cls), {})

