"""Fair admission across tenants: virtual-token counters (VTC, "Fairness in Serving Large Language Models", Sheng et
al. 2024, the fair scheduler of S-LoRA), which :class:`~skyrl_clora.sampler.scheduler.Scheduler` keeps with
``admission="fair"``.

Each tenant (an adapter name; None for the base model) has a counter of the service it received: a request admitted
adds :data:`PREFILL_WEIGHT` per prompt token, and each decode step adds :data:`DECODE_WEIGHT` per request running in
it (the paper's weights: an output token costs two input tokens). Admission considers the waiting requests tenant by
tenant, the tenant with the smallest counter first (ties: the tenant whose first request waits longest), each
tenant's in arrival order (:func:`fair_order`). A tenant that becomes active (a request waits or runs) after it was
not is lifted to the smallest counter of the tenants that were active before (:meth:`ServiceCounters.observe`), so
idle time is not banked: a tenant arriving while others flood the queue is admitted after at most one admission of
each tenant tied with it at that minimum.

While every device adapter slot holds an adapter (more tenants active than slots), a tenant whose adapter holds a slot
keeps a credit in the order (:func:`tenure_key`): it is served up to ``credit`` counter units ahead of tenants whose
adapters would need a slot, and a waiting tenant drains a slot only from a tenant that is past its credit (the
scheduler's ``slot_credit``). So a slot
serves its tenant for a tenure (a GRPO group's turns, not one request) before it changes hands, and a waiting tenant
is served once a resident one is ``credit`` ahead of it (plus what that tenant's running requests still take).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Container, Iterator
from typing import Protocol

ADMISSIONS = ("fifo", "fair")  # the scheduler's admission orders: arrival order, or by these counters
PREFILL_WEIGHT = 1.0  # counter units per prompt token admitted
DECODE_WEIGHT = 2.0  # counter units per token a decode step computes for a running request
# A resident tenant's credit, in requests of the engine's longest length: chosen from 0, 0.5 and 2 by the fewest slot
# loads (RESULTS.md, "Many tenants on few adapter slots"); larger credits spread the tenants' queue waits more.
SLOT_CREDIT_REQUESTS = 2.0


class _Request(Protocol):
    adapter: str | None
    prompt_ids: list[int]


class ServiceCounters:
    """The tenants' virtual-token counters (module docstring). Host bookkeeping, driven by the scheduler alone."""

    def __init__(self) -> None:
        self._value: dict[str | None, float] = {}
        self._active: set[str | None] = set()
        self._running: dict[str | None, int] = {}  # requests running, by tenant (none: absent)

    def value(self, tenant: str | None) -> float:
        """``tenant``'s counter (0.0 for one never seen)."""
        return self._value.get(tenant, 0.0)

    def admitted(self, request: _Request) -> None:
        """``request`` was admitted: its tenant is charged its prompt tokens."""
        self._value[request.adapter] = self.value(request.adapter) + PREFILL_WEIGHT * len(request.prompt_ids)

    def started(self, tenant: str | None) -> None:
        """A request of ``tenant`` runs (in a row) from now on."""
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def stopped(self, tenant: str | None) -> None:
        """A request of ``tenant`` that ran (:meth:`started`) runs no more."""
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]

    def decoded(self) -> None:
        """A decode step computes one token for each running request: their tenants are charged."""
        for tenant, count in self._running.items():
            self._value[tenant] = self.value(tenant) + DECODE_WEIGHT * count

    def forget(self, tenant: str | None) -> None:
        """``tenant`` is gone (its adapter unregistered, none of its requests running): its counter is dropped, so
        a tenant registered later under its name starts as a new one (lifted to the active tenants' floor)."""
        self._value.pop(tenant, None)
        self._active.discard(tenant)

    def observe(self, active: set[str | None]) -> None:
        """The tenants with a request waiting or running now are ``active``: each that was not active at the last
        call is lifted to the smallest counter of those that were (still active, or else all of them), if above its
        own."""
        new = active - self._active
        if new:
            reference = (active & self._active) or self._active
            if reference:
                floor = min(self.value(tenant) for tenant in reference)
                for tenant in new:
                    self._value[tenant] = max(self.value(tenant), floor)
        self._active = set(active)


def fair_order(waiting: list[_Request], counters: ServiceCounters, resident: frozenset[str | None] = frozenset(),
               credit: float = 0.0, held: Container[str | None] = frozenset()) -> Iterator[_Request]:
    """The requests of ``waiting`` (in queue order) in the order admission considers them: repeatedly the first
    not yet yielded of the tenant with the smallest key, its counter less ``credit`` when it is in ``resident``
    (:func:`tenure_key`; ties: the tenant seen first in ``waiting``). Keys are read again after each yield, so a
    request admitted meanwhile (:meth:`ServiceCounters.admitted`) moves its tenant back; only the yielded request's
    tenant may be charged between two yields. A tenant the caller adds to ``held`` between two yields has no more of
    its requests yielded."""
    queues: dict[str | None, deque] = {}
    for request in waiting:
        queues.setdefault(request.adapter, deque()).append(request)
    heap = [(tenure_key(counters, tenant, resident, credit), rank, tenant) for rank, tenant in enumerate(queues)]
    heapq.heapify(heap)
    while heap:
        _, rank, tenant = heapq.heappop(heap)
        queue = queues[tenant]
        yield queue.popleft()
        if queue and tenant not in held:
            heapq.heappush(heap, (tenure_key(counters, tenant, resident, credit), rank, tenant))


def slot_credit(max_len: int) -> float:
    """The slot credit (:func:`tenure_key`) of an engine whose requests are at most ``max_len`` tokens:
    :data:`SLOT_CREDIT_REQUESTS` times the counter units one such request's decode steps add."""
    return SLOT_CREDIT_REQUESTS * DECODE_WEIGHT * max_len


def tenure_key(counters: ServiceCounters, tenant: str | None, resident: frozenset[str | None], credit: float) -> float:
    """``tenant``'s place in the fair order: its counter, less ``credit`` while its adapter holds a device slot
    (``resident``), so that a resident tenant is served up to ``credit`` counter units ahead of one that would need a
    slot loaded before another tenant's slot is taken for it."""
    return counters.value(tenant) - (credit if tenant in resident else 0.0)
