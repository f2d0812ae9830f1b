"""A tenant's learning-rate schedule: SkyRL's (Hugging Face's) schedulers as a pure function of the optimizer step,
kept with the tenant's optimizer state on the host (``AdapterStore``'s ``TenantState.schedule``) and read by the
trainer before each AdamW step (:func:`~skyrl_clora.trainer.optim.adamw_slot`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

LR_SCHEDULES = ("constant_with_warmup", "constant", "cosine")
"""The ``transformers.SchedulerType`` names (SkyRL's ``optimizer_config.scheduler``) :class:`LRSchedule` takes: the
values ``trainer.policy.optimizer_config.scheduler`` accepts on both backends."""


@functools.lru_cache(maxsize=256)
def _hf_lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The LR factor per optimizer step of ``transformers.get_scheduler(kind, ...)``: the scheduler SkyRL's FSDP
    strategy builds from ``optimizer_config`` (``num_warmup_steps``, ``num_training_steps``), read off a throwaway
    optimizer."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps).lr_lambdas[0]


@dataclass(frozen=True)
class LRSchedule:
    """``lr(step)``: the learning rate of optimizer step ``step`` (0-based) under SkyRL's scheduler ``kind`` (a name of
    :data:`LR_SCHEDULES`): ``base_lr`` times the factor of Hugging Face's ``get_scheduler(kind, num_warmup_steps=
    warmup_steps, num_training_steps=total_steps)`` after ``step`` scheduler steps. So warm-up step ``k`` runs at
    ``base_lr * k / warmup_steps`` (the first at 0), ``constant`` ignores the warm-up, and ``cosine`` decays to 0 at
    ``total_steps``."""

    base_lr: float
    warmup_steps: int = 0
    total_steps: int = 1
    kind: str = "constant_with_warmup"

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}; use one of {', '.join(LR_SCHEDULES)}")
        if self.base_lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {self.base_lr}")

    def lr(self, step: int) -> float:
        return self.base_lr * _hf_lr_lambda(self.kind, self.warmup_steps, self.total_steps)(step)
