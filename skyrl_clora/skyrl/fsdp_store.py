"""A LoRA AdapterStore for SkyRL's FSDP2 policy worker: one slot per tenant, swapped through one live model.

SkyRL 0.4's FSDP worker trains one PEFT LoRA adapter (``HFModelWrapper`` + ``fully_shard``, one ``torch.optim.AdamW``
and one Hugging Face ``LambdaLR`` scheduler). :class:`FSDPAdapterStore` keeps, per tenant, everything that
makes that adapter's training its own, in host memory (page-locked when the model is on CUDA, one block per table:
:func:`~skyrl_clora.device.pinned_memory.host_like`), and swaps it through
the live objects with ``copy_``, never reallocating them, so FSDP2's sharded DTensor parameters, the optimizer's
state tensors and the scheduler stay the same Python objects:

- the LoRA parameters' local shards (``lora_A``/``lora_B`` of every adapted module): these sharded fp32
  parameters are also the master weights; FSDP2's ``MixedPrecisionPolicy`` casts a bf16 copy per forward and
  keeps no other copy;
- their gradients' local shards, when a ``forward_backward`` left some that no ``optim_step`` consumed yet;
- AdamW's ``exp_avg`` / ``exp_avg_sq`` local shards and each parameter's ``step``;
- the LR scheduler's state (``base_lrs`` = the tenant's LR, ``last_epoch``, ``_last_lr``) and the param group's
  ``lr``/``initial_lr``: each tenant runs its own schedule;
- the torch RNG states (CPU, and the current CUDA device's).

Shapes: every slot tensor has the shape and dtype of the live local shard it mirrors (``DTensor.to_local()``; the
whole tensor on one rank). A new tenant's slot is its initial adapter: LoRA A drawn as PEFT draws it
(``kaiming_uniform_(a=sqrt(5))`` for SkyRL's ``init_method=kaiming``, ``normal_(std=1/rank)`` for ``gaussian``)
from a CPU generator seeded by (tenant seed, parameter name), the full tensor drawn and this rank's shard kept,
so the adapter does not depend on the world size; LoRA B zero (the adapter starts as the base model); zero
moments, step 0, the scheduler as SkyRL built it with the tenant's LR as base LR, RNG seeded with the tenant
seed.

Invariants, checked loudly: every trainable parameter is a LoRA parameter (otherwise a swap would leave a shared
trainable tensor that every tenant steps); the optimizer is non-fused, non-capturable AdamW without amsgrad
(the only state layout the store mirrors) and every trainable parameter has its state after
:meth:`FSDPAdapterStore.prime`; every registered tenant has the store's :class:`FSDPLoraSignature`.

Collectives: none; a swap is local ``copy_``s on every rank, which all take the same call (SkyRL's
``pass_through`` dispatch); callers put ``dist.barrier()`` around it as :meth:`FSDPAdapterStore.swap_to` does.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from skyrl_clora.device.pinned_memory import host_like

LORA_MARKERS = (".lora_A.", ".lora_B.")
SCHEDULE_KEYS = ("base_lrs", "last_epoch", "_step_count", "_last_lr")
"""The scheduler state a tenant owns (the rest of ``LambdaLR.state_dict()`` is the shared schedule's shape)."""


@dataclass(frozen=True)
class FSDPLoraSignature:
    """What every tenant on one worker shares: LoRA rank/alpha/targets/init, the world size, and each trainable
    parameter's name and global shape (in the live model's order)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    init_method: str
    world_size: int
    params: tuple[tuple[str, tuple[int, ...]], ...]

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules),
                "init_method": self.init_method, "world_size": self.world_size,
                "params": [[name, list(shape)] for name, shape in self.params]}


@dataclass
class TenantSlot:
    """One tenant's host state (see the module docstring); lists are in the signature's parameter order."""

    seed: int
    lr: float
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    steps: torch.Tensor
    """``[P]`` float64: each parameter's AdamW ``step``."""
    schedule: dict[str, Any]
    rng_cpu: torch.Tensor
    rng_cuda: Optional[torch.Tensor]
    has_grads: bool = False


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def lora_a_initializer(init_method: str, rank: int) -> Callable[[torch.Tensor, torch.Generator], None]:
    """PEFT's LoRA A initialiser for SkyRL's ``lora.init_method`` (``HFModelWrapper`` maps ``kaiming`` to PEFT's
    default and passes any other name to PEFT), drawing from ``generator``."""
    if init_method == "kaiming":
        return lambda tensor, generator: torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
    if init_method == "gaussian":
        return lambda tensor, generator: torch.nn.init.normal_(tensor, std=1 / rank, generator=generator)
    raise ValueError(f"trainer.policy.model.lora.init_method={init_method}: per-tenant FSDP adapters are drawn "
                     "for kaiming or gaussian only; set one of them")


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def trainable_lora_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Every trainable parameter of ``module`` with its name; raises unless all are LoRA A/B parameters."""
    params = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
    others = [name for name, _ in params if not any(marker in name for marker in LORA_MARKERS)]
    if others:
        raise RuntimeError(f"FSDPAdapterStore: trainable non-LoRA parameter {others[0]!r}; tenants would share "
                           "and all step it. Refusing to build the store")
    if not params:
        raise RuntimeError("FSDPAdapterStore: the model has no trainable LoRA parameter (lora.rank must be > 0)")
    return params


def check_adamw(optimizer: torch.optim.Optimizer) -> None:
    """Raises unless ``optimizer`` is the AdamW whose per-parameter state the store mirrors."""
    if not isinstance(optimizer, torch.optim.AdamW):
        raise RuntimeError(f"FSDPAdapterStore mirrors torch.optim.AdamW's state; the worker has {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for option in ("amsgrad", "capturable", "fused", "differentiable"):
            if group.get(option):
                raise RuntimeError(f"FSDPAdapterStore: AdamW with {option}=True keeps state the store does not mirror")


class FSDPAdapterStore:
    """Per-worker registry of tenant slots over one live FSDP2 LoRA model, optimizer and scheduler.

    Build it after SkyRL's ``init_model``; :meth:`prime` then materialises AdamW's state (as SkyRL's Megatron
    ``prime_optimizer_state``), :meth:`register_pristine` captures the signature and the scheduler as built,
    :meth:`create` adds tenants and :meth:`swap_to` makes one live."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        named = trainable_lora_params(module)
        check_adamw(optimizer)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            raise RuntimeError(f"FSDPAdapterStore: per-tenant LR schedules need a LambdaLR (Hugging Face's "
                               f"get_scheduler); the worker has {type(scheduler).__name__}")
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.optimizer, self.scheduler = optimizer, scheduler
        self.slots: dict[str, TenantSlot] = {}
        self.current_id: Optional[str] = None
        self.signature: Optional[FSDPLoraSignature] = None
        self._pristine_schedule: Optional[dict[str, Any]] = None
        self._pin = any(local(p).is_cuda for p in self.params)

    # ---- set-up --------------------------------------------------------------------------------------

    @torch.no_grad()
    def prime(self) -> None:
        """Creates AdamW's state for every trainable parameter as AdamW's own first step would (zero moments,
        step 0), so each tenant's state can be copied in before its first step."""
        for param in self.params:
            state = self.optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def register_pristine(self, signature: FSDPLoraSignature) -> None:
        """Fixes the signature every tenant must have and the scheduler state new tenants start from."""
        if self.signature is not None:
            raise RuntimeError("FSDPAdapterStore.register_pristine called twice")
        shapes = tuple((name, tuple(param.shape)) for name, param in zip(self.names, self.params))
        if signature.params != shapes:
            raise ValueError("FSDPAdapterStore: the signature's parameters are not the live model's")
        for param in self.params:
            if set(self.optimizer.state[param]) != {"step", "exp_avg", "exp_avg_sq"}:
                raise RuntimeError("FSDPAdapterStore: AdamW state missing or unexpected; call prime() first")
        self.signature = signature
        self._pristine_schedule = {key: copy.deepcopy(value) for key, value in self.scheduler.state_dict().items()}

    # ---- slots ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def create(self, model_id: str, seed: int, lr: float, signature: FSDPLoraSignature) -> None:
        """Registers ``model_id`` with its initial slot (module docstring); the live state is not touched."""
        if self.signature is None:
            raise RuntimeError("FSDPAdapterStore.create called before register_pristine")
        if signature != self.signature:
            raise ValueError(f"FSDPAdapterStore: LoRA signature mismatch for {model_id!r}: the store holds "
                             f"{self.signature.as_json()}, requested {signature.as_json()}; tenants on one worker "
                             "need one rank, alpha, targets and init method")
        if model_id in self.slots:
            raise ValueError(f"FSDPAdapterStore: adapter {model_id!r} already registered")
        if lr <= 0:
            raise ValueError(f"FSDPAdapterStore: tenant {model_id!r} learning rate must be > 0, got {lr}")
        draw = lora_a_initializer(self.signature.init_method, self.signature.rank)
        live = [local(param) for param in self.params]
        params, grads, exp_avg, exp_avg_sq = (host_like(live, self._pin) for _ in range(4))  # one block per table
        for name, param, host in zip(self.names, self.params, params):
            full = torch.zeros(param.shape, dtype=torch.float32)
            if ".lora_A." in name:
                draw(full, _generator(seed, name))
            host.copy_(self._local_part(full, param))
        torch._foreach_zero_(exp_avg + exp_avg_sq)
        slot = TenantSlot(
            seed=seed, lr=lr, params=params, grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
            steps=torch.zeros(len(self.params), dtype=torch.float64),
            schedule=self.fresh_schedule(lr),
            rng_cpu=torch.Generator().manual_seed(seed).get_state(),
            rng_cuda=(torch.Generator(device=torch.device("cuda", torch.cuda.current_device())).manual_seed(seed)
                      .get_state() if self._pin else None),
        )
        self.slots[model_id] = slot

    @staticmethod
    def _local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of the global tensor ``full`` as ``param`` is laid out (its DTensor placements)."""
        if not isinstance(param, DTensor):
            return full
        mesh = param.device_mesh
        return distribute_tensor(full.to(mesh.device_type), mesh, param.placements, src_data_rank=None).to_local()

    def fresh_schedule(self, lr: float) -> dict[str, Any]:
        """The scheduler state as SkyRL built it, with ``lr`` as every group's base LR."""
        state = {key: copy.deepcopy(self._pristine_schedule[key]) for key in SCHEDULE_KEYS}
        state["base_lrs"] = [float(lr)] * len(state["base_lrs"])
        state["_last_lr"] = [float(lr) * fn(state["last_epoch"]) for fn in self.scheduler.lr_lambdas]
        return state

    def delete(self, model_id: str) -> None:
        """Drops ``model_id``'s slot; if it was live, nothing is live any more (the next swap only restores)."""
        if model_id not in self.slots:
            raise KeyError(f"FSDPAdapterStore: unknown adapter {model_id!r}")
        del self.slots[model_id]
        if self.current_id == model_id:
            self.current_id = None

    # ---- swapping ------------------------------------------------------------------------------------

    @torch.no_grad()
    def snapshot(self, slot: TenantSlot) -> None:
        """Copies the live state into ``slot`` (gradients only when some exist; AdamW's ``zero_grad`` frees them)."""
        grads = [param.grad for param in self.params]
        slot.has_grads = any(grad is not None for grad in grads)
        for i, param in enumerate(self.params):
            state = self.optimizer.state[param]
            slot.params[i].copy_(local(param), non_blocking=True)
            slot.exp_avg[i].copy_(local(state["exp_avg"]), non_blocking=True)
            slot.exp_avg_sq[i].copy_(local(state["exp_avg_sq"]), non_blocking=True)
            slot.steps[i] = float(state["step"])
            if grads[i] is not None:
                slot.grads[i].copy_(local(grads[i]), non_blocking=True)
            elif slot.has_grads:
                slot.grads[i].zero_()
        slot.schedule = {key: copy.deepcopy(self.scheduler.__dict__[key]) for key in SCHEDULE_KEYS}
        slot.rng_cpu = torch.get_rng_state()
        slot.rng_cuda = torch.cuda.get_rng_state() if self._pin else None
        self._sync()

    @torch.no_grad()
    def restore(self, slot: TenantSlot) -> None:
        """Copies ``slot`` into the live state (the gradients are dropped when the slot has none)."""
        for i, param in enumerate(self.params):
            state = self.optimizer.state[param]
            local(param).copy_(slot.params[i], non_blocking=True)
            local(state["exp_avg"]).copy_(slot.exp_avg[i], non_blocking=True)
            local(state["exp_avg_sq"]).copy_(slot.exp_avg_sq[i], non_blocking=True)
            state["step"].fill_(float(slot.steps[i]))
            if slot.has_grads:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                local(param.grad).copy_(slot.grads[i], non_blocking=True)
            else:
                param.grad = None
        self.scheduler.__dict__.update(copy.deepcopy(slot.schedule))
        for group, lr, base in zip(self.optimizer.param_groups, slot.schedule["_last_lr"], slot.schedule["base_lrs"]):
            group["lr"], group["initial_lr"] = lr, base
        torch.set_rng_state(slot.rng_cpu)
        if slot.rng_cuda is not None:
            torch.cuda.set_rng_state(slot.rng_cuda)
        self._sync()

    def _sync(self) -> None:
        if self._pin:
            torch.cuda.current_stream().synchronize()

    def swap_to(self, model_id: str) -> None:
        """Makes ``model_id`` the live adapter.

        1. nothing to do when it is live already;
        2. ``dist.barrier()`` (every rank of the group swaps in the same call);
        3. snapshot live -> the current tenant's slot (skipped when none is live: after start or a delete);
        4. restore the target's slot -> live (``copy_`` into the same tensors), CUDA stream synchronised after each
           direction;
        5. ``dist.barrier()``: every rank agrees on the live adapter before the next collective.
        """
        if model_id not in self.slots:
            raise KeyError(f"FSDPAdapterStore: unknown adapter {model_id!r}; register it first")
        if self.current_id == model_id:
            return
        if dist.is_initialized():
            dist.barrier()
        if self.current_id is not None:
            self.snapshot(self.slots[self.current_id])
        self.restore(self.slots[model_id])
        self.current_id = model_id
        if dist.is_initialized():
            dist.barrier()

    def tenant_step(self, model_id: str) -> int:
        """The optimizer steps ``model_id`` has taken (its scheduler's ``last_epoch``, live or in its slot)."""
        if model_id == self.current_id:
            return int(self.scheduler.last_epoch)
        return int(self.slots[model_id].schedule["last_epoch"])
