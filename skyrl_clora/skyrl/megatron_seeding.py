"""Per-tenant initial adapters on SkyRL's Megatron policy worker: the run-time form of
integration/patches/0002 (``register_adapter(model_id, seed)`` upstream), for SkyRL 0.4 as released.

SkyRL 0.4's ``MegatronPolicyWorkerBase.register_adapter(model_id)`` gives every adapter a copy of one pristine
slot (``AdapterStore.create``), so every tenant starts from the same LoRA A matrices whatever its seed (SkyRL's
Tinker backend also drops ``LoraConfig.seed``). :func:`with_seeded_tenant_adapters` derives a worker class whose
``register_adapter`` then re-draws the new adapter's LoRA with the tenant's own seed:

  1. SkyRL's registration (signature check, a slot seeded from the pristine one);
  2. when the worker was given a seed for ``model_id`` (:meth:`SeededTenantAdaptersMixin.set_adapter_seeds`;
     the KL reference and any id without a seed keep the pristine adapter), swap the new adapter live;
  3. every LoRA A parameter (``...adapter.linear_in.weight``) of this rank's model chunks is re-drawn as
     Megatron-Bridge initialises it (``xavier_uniform_`` for ``init_method=xavier``, else
     ``kaiming_uniform_(a=sqrt(5))``) from a CPU generator seeded by (tenant seed, this rank's tensor/pipeline/
     expert-parallel coordinates, parameter name): data-parallel replicas draw the same values, every shard its
     own; LoRA B (``linear_out``) stays zero, so the adapter still starts as the base model;
  4. the optimizer's fp32 main parameters are reloaded from the model's (``reload_model_params``); the
     AdapterStore snapshots the live state into the tenant's slot at the next swap.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

LORA_A_SUFFIX = "adapter.linear_in.weight"
LORA_B_SUFFIX = "adapter.linear_out.weight"


def parallel_coordinates() -> tuple[int, int, int]:
    """This rank's (tensor, pipeline, expert) model-parallel ranks (Megatron's ``parallel_state``)."""
    from megatron.core import parallel_state as mpu

    expert = mpu.get_expert_model_parallel_rank() if hasattr(mpu, "get_expert_model_parallel_rank") else 0
    return mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(), expert


def lora_a_init(init_method: str) -> Callable[[torch.Tensor, torch.Generator], None]:
    """Megatron-Bridge's LoRA A initialiser for SkyRL's ``lora.init_method``, drawing from ``generator``."""
    if init_method == "xavier":
        return lambda tensor, generator: torch.nn.init.xavier_uniform_(tensor, generator=generator)
    if init_method == "kaiming":
        return lambda tensor, generator: torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
    raise ValueError(f"lora.init_method={init_method}: seeded tenant adapters know xavier and kaiming only")


def _generator(seed: int, coordinates: tuple[int, int, int], name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{coordinates}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class SeededTenantAdaptersMixin:
    """``register_adapter`` that re-draws a seeded tenant's LoRA after SkyRL's registration (module docstring)."""

    _clora_adapter_seeds: dict[str, int] = {}

    def set_adapter_seeds(self, seeds: dict[str, int]) -> None:
        """The seed of each adapter id this worker will register (other ids keep the pristine adapter)."""
        self._clora_adapter_seeds = dict(seeds)

    def register_adapter(self, model_id: str) -> None:
        super().register_adapter(model_id)  # type: ignore[misc]
        seed = self._clora_adapter_seeds.get(model_id)
        if seed is None:
            return
        self.swap_to_adapter(model_id)  # type: ignore[attr-defined]
        init = lora_a_init(self.cfg.policy.model.lora.init_method)  # type: ignore[attr-defined]
        coordinates = parallel_coordinates()
        drawn = 0
        with torch.no_grad():
            for chunk in self.actor_module:  # type: ignore[attr-defined]
                for name, param in chunk.named_parameters():
                    if name.endswith(LORA_A_SUFFIX):
                        values = torch.empty(param.shape, dtype=torch.float32)
                        init(values, _generator(seed, coordinates, name))
                        param.copy_(values)
                        drawn += 1
                    elif name.endswith(LORA_B_SUFFIX) and torch.count_nonzero(param):
                        raise RuntimeError(f"adapter {model_id}: {name} is not zero after registration; a seeded "
                                           "re-draw of LoRA A would not start from the base model")
        if drawn == 0:
            raise RuntimeError(f"adapter {model_id}: no parameter ends with {LORA_A_SUFFIX}; the LoRA layout does not "
                               "match Megatron-Bridge's")
        self.optimizer.reload_model_params()  # type: ignore[attr-defined]


def with_seeded_tenant_adapters(worker_cls: type) -> type:
    """``worker_cls`` (SkyRL's Megatron policy worker class) with :class:`SeededTenantAdaptersMixin` in front."""
    for name in ("register_adapter", "swap_to_adapter"):
        if not callable(getattr(worker_cls, name, None)):
            raise TypeError(f"{worker_cls.__name__} has no {name}; the installed SkyRL has no Megatron AdapterStore")
    return type(f"Seeded{worker_cls.__name__}", (SeededTenantAdaptersMixin, worker_cls), {})
