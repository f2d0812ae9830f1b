"""One admission round's decisions over the engine's device adapter slots (:class:`SlotRound`): which adapters are
busy, which waiting adapter may take a slot now, and which busy adapter is drained for one that waits (the rules are
the scheduler's, :mod:`skyrl_clora.sampler.scheduler`). Host bookkeeping of the scheduler's round, nothing else."""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.fair_share import ServiceCounters

if TYPE_CHECKING:
    from skyrl_clora.sampler.requests import PrefillPlan, QueuedRequest


class SlotRound:
    """One admission round's decisions over the device slots (:class:`AdapterSlots`), recorded in ``plan``: the
    adapters busy (with a request running or admitted in the round), and those drained for adapters waiting for a
    slot (the rules: the scheduler's module docstring)."""

    def __init__(self, adapters: AdapterSlots, rows: list[QueuedRequest | None], queue: list[QueuedRequest],
                 plan: PrefillPlan, service: ServiceCounters | None, credit: float) -> None:
        self.adapters = adapters
        self.plan = plan
        self.service = service
        self.credit = credit
        self.busy = {req.adapter for req in rows if req is not None}
        self.queued = {req.adapter for req in queue}  # adapters with requests waiting at the round's start
        self.waiting: set[str] = set()
        self.draining: set[str] = set()
        self._drain_bound: float | None = None  # fair: the largest counter less credit of a drainable adapter (cache)

    def holds_back(self, adapter: str | None) -> bool:
        """Whether a request of ``adapter`` waits for a slot: its adapter is drained for one queued before it, or it
        holds no slot and none is free or held by an idle adapter (a busy adapter not drained yet is then drained for
        it: the least recently used of those with no request queued, else of all; under fair admission only among
        those past their slot credit, :func:`tenure_key`)."""
        if adapter is None:
            return False
        if adapter in self.draining or adapter in self.waiting:  # both only grow within a round, and slots only fill
            return True
        if self.adapters.resident(adapter) or self.adapters.available(self.busy):
            return False
        self.waiting.add(adapter)
        if self.service is not None and self._fair_drain_bound() <= self.service.value(adapter):
            return True  # no busy adapter is past its credit ahead of this one
        first = None  # the least recently used candidate, drained when every candidate has requests queued
        for name in self.adapters.lru():
            if name in self.busy and name not in self.draining and self._past_credit(name, adapter):
                if name not in self.queued:
                    first = name
                    break
                if first is None:
                    first = name
        if first is not None:
            self.draining.add(first)
            self._drain_bound = None
        return True

    def _fair_drain_bound(self) -> float:
        """Under fair admission, the largest counter less the credit of the busy adapters not drained: no slot may
        be drained for a waiting adapter whose counter is at least that (:meth:`_past_credit`)."""
        if self._drain_bound is None:
            self._drain_bound = max((self.service.value(name) - self.credit for name in self.adapters.lru()
                                     if name in self.busy and name not in self.draining), default=float("-inf"))
        return self._drain_bound

    def _past_credit(self, resident: str, waiting: str) -> bool:
        """Whether ``resident``'s slot may be drained for ``waiting``: always under fifo; under fair admission once
        ``resident``'s counter is more than the credit above ``waiting``'s."""
        if self.service is None:
            return True
        return self.service.value(resident) - self.credit > self.service.value(waiting)

    def admitted(self, req: QueuedRequest) -> None:
        """``req`` (not held back) was admitted: sets its ``lora_slot``; its adapter becomes the most recently used,
        or is given a slot (:meth:`AdapterSlots.assign`) and named in the plan's ``loads``."""
        if req.adapter is None:
            req.lora_slot = -1
            return
        if self.adapters.resident(req.adapter):
            self.adapters.touch(req.adapter)
            self.plan.hits += 1
        else:
            self.plan.evictions += self.adapters.assign(req.adapter, self.busy, self.queued) is not None
            self.plan.loads.append(req.adapter)
        self.busy.add(req.adapter)
        self._drain_bound = None  # its counter is charged for the admission next
        req.lora_slot = self.adapters.slot(req.adapter)
