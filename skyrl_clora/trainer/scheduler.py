"""The train scheduler: tenant loops hand it their batches; it runs the trainer, one pass at a time, off the
event loop.

- swap mode: the waiting tenants train one at a time, the first by ``priority`` first; while one trains, the
  next by priority is prefetched into the trainer's second slot (``Trainer.train_step(..., prefetch=)``).
- packed mode: whenever the trainer is free, the waiting tenants train in one packed pass
  (``Trainer.train_packed``): all of them when they fit ``clora.pack_size``; else the pass of the pack plan
  (:func:`plan_packs` over every waiting batch, :func:`pack_cost_model`) that holds the first by priority.
- ``priority`` (``clora.train_priority``, :data:`TRAIN_PRIORITIES`): ``arrival`` ranks the waiting requests by
  arrival; ``fewest_updates`` by the passes their tenant has had in this scheduler, fewest first, then by arrival.
  In a run whose tenants all run the same steps, fewest updates is most steps still to run: its tenant's next
  rollout waits on this pass, while a tenant's last pass unblocks nothing, so the trainer serves first the
  passes that put rows back into the decode batch.
  With ``lockstep``, a round of passes starts once every member tenant (``join`` / ``leave``) has its batch
  waiting, and its passes are the pack plan's of the round's batches (the batches in member order): the
  passes' composition then depends on nothing but the members and their batches, so runs are reproducible
  (the CPU rounds a GEMM's rows by the batch they are in) and a resumed run packs as the uninterrupted one did.
A tenant whose batch is invalid fails alone (its ``train`` call raises); if a pass itself raises, the
tenants of that pass fail and the others keep going.

Given a ``sampler`` to pause (the engine), a pass that starts while at least ``pause_rows`` of its rows are
decoding runs with sampling paused, so the GPU runs one workload at a time instead of sharing itself between
a training pass and a full decode batch; with fewer rows decoding (a long-tailed step's last episodes), the
pass runs beside them and fills the GPU they leave idle. ``pause_rows=0`` pauses for every pass
(``clora.overlap_sampling=false``); no sampler never pauses (``true``).

Every pass is recorded (:attr:`TrainScheduler.passes`, :class:`TrainPass`): its tenants, when each of their
requests arrived, its start and end on the host clock and whether it paused sampling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.trainer.batch import TrainBatch, validate_batch
from skyrl_clora.trainer.pack_plan import PackCostModel, pack_load, plan_packs
from skyrl_clora.trainer.trainer import Trainer

TRAIN_MODES = ("swap", "packed")
TRAIN_PRIORITIES = ("arrival", "fewest_updates")  # clora.train_priority: see the module docstring
Result = TypeVar("Result")


class PausableSampler(Protocol):
    """What the scheduler needs of a sampler to keep it off the GPU during a pass (``Engine`` has it)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def running_rows(self) -> int: ...


@dataclass
class _Request:
    tenant: str
    batch: TrainBatch
    result: asyncio.Future
    arrived: float  # time.perf_counter() when train() was called


@dataclass(frozen=True)
class TrainPass:
    """One training call: its ``tenants`` (in pass order), the host time (``time.perf_counter()``) each one's request
    ``arrived``, the call's ``start`` and ``end`` (with the pause around it), whether it ``paused`` sampling, and the
    rows the sampler was decoding when it started (``rows_decoding``; None without a sampler)."""

    tenants: tuple[str, ...]
    arrived: tuple[float, ...]
    start: float
    end: float
    paused: bool
    rows_decoding: int | None


class TrainScheduler:
    """Queues ``(tenant, batch)`` requests and drains them through ``trainer`` in ``mode`` (swap or packed), the
    waiting ones ranked by ``priority`` (a name of :data:`TRAIN_PRIORITIES`); with ``sampler``, sampling is paused
    for each pass that starts while at least ``pause_rows`` rows decode. ``passes``: every pass so far, in order
    (:class:`TrainPass`)."""

    def __init__(self, trainer: Trainer, mode: str, sampler: PausableSampler | None = None, pause_rows: int = 0,
                 lockstep: bool = False, priority: str = "arrival") -> None:
        if mode not in TRAIN_MODES:
            raise ValueError(f"train mode {mode!r} is unknown; use swap or packed")
        if priority not in TRAIN_PRIORITIES:
            raise ValueError(f"train priority {priority!r} is unknown; use {' or '.join(TRAIN_PRIORITIES)}")
        self.trainer = trainer
        self.mode = mode
        if lockstep and mode != "packed":
            raise ValueError("lockstep rounds are packed passes; use mode packed")
        self.sampler = sampler
        self.pause_rows = pause_rows
        self.lockstep = lockstep
        self.priority = priority
        self._members: list[str] = []  # lockstep: the tenants a round waits for, in the order they joined
        self.passes: list[TrainPass] = []
        self._updates: dict[str, int] = {}  # passes each tenant has been in (fewest_updates ranks by it)
        self._waiting: list[_Request] = []
        self._drainer: asyncio.Task | None = None

    @property
    def pass_seconds(self) -> float:
        """The passes' time so far (with the pauses around them)."""
        return sum(p.end - p.start for p in self.passes)

    @property
    def pass_intervals(self) -> list[tuple[float, float]]:
        """Each pass's ``(start, end)`` on the host clock (``time.perf_counter()``), in order."""
        return [(p.start, p.end) for p in self.passes]

    @property
    def paused_passes(self) -> int:
        """How many passes paused sampling."""
        return sum(p.paused for p in self.passes)

    def join(self, tenant: str) -> None:
        """Lockstep: rounds wait for ``tenant``'s batch from now on (call when it is registered)."""
        self._members.append(tenant)

    def leave(self, tenant: str) -> None:
        """Lockstep: rounds no longer wait for ``tenant`` (it trains no more: finished, stopped or failed)."""
        if tenant in self._members:
            self._members.remove(tenant)
            self._kick()

    async def train(self, tenant: str, batch: TrainBatch) -> tuple[AdapterWeights, dict[str, float]]:
        """Trains ``tenant`` on ``batch`` in the next pass that has room (lockstep: in the round every member's
        batch joins); returns its new weights and metrics (``pass_tenants``: how many tenants shared the pass)."""
        request = _Request(tenant, batch, asyncio.get_running_loop().create_future(), time.perf_counter())
        self._waiting.append(request)
        self._kick()
        return await request.result

    def _kick(self) -> None:
        """Starts draining unless a drain runs or (lockstep) a member's batch is still to come."""
        if self._drainer is None and self._ready():
            self._drainer = asyncio.create_task(self._drain())

    def _ready(self) -> bool:
        if not self.lockstep:
            return bool(self._waiting)
        waiting = {request.tenant for request in self._waiting}
        return bool(waiting) and all(member in waiting for member in self._members)

    def _first(self) -> _Request:
        """The waiting request ``priority`` ranks first (``_waiting`` is in arrival order; ``min`` keeps the earliest
        of equals)."""
        if self.priority == "arrival":
            return self._waiting[0]
        return min(self._waiting, key=lambda request: self._updates.get(request.tenant, 0))

    async def _next_passes(self) -> list[list[_Request]]:
        """What trains next: lockstep, the whole round (in member order) as the pack plan's passes; swap mode, the
        first waiting request by priority; packed mode, every waiting request when they fit ``pack_size``, else the
        plan's pass holding the first by priority. The plan is made on a worker thread (a large round's takes up to
        about a second)."""
        size = self.trainer.pack_size if self.mode == "packed" else 1
        if self.lockstep:
            order = {name: index for index, name in enumerate(self._members)}
            taken = sorted(self._waiting, key=lambda request: order.get(request.tenant, len(order)))
            self._waiting = []
            return await asyncio.to_thread(self._plan, taken, size)
        if len(self._waiting) <= size:
            taken, self._waiting = self._waiting, []
            return [taken]
        first = self._first()
        if size == 1:
            self._waiting.remove(first)
            return [[first]]
        waiting = list(self._waiting)
        taken = next(group for group in await asyncio.to_thread(self._plan, waiting, size)
                     if any(request is first for request in group))
        chosen = {id(request) for request in taken}
        self._waiting = [request for request in self._waiting if id(request) not in chosen]
        return [taken]

    def _plan(self, requests: list[_Request], size: int) -> list[list[_Request]]:
        """``requests`` as the pack plan's passes of at most ``size`` (deterministic given their order and batches)."""
        store = self.trainer.store
        loads = [pack_load(str(index), request.batch, getattr(store.tenants.get(request.tenant), "rank", store.max_rank),
                           self.trainer.mini_batch_prompts, self.trainer.update_epochs)
                 for index, request in enumerate(requests)]
        return [[requests[int(name)] for name in names] for names in plan_packs(loads, size, pack_cost_model(self.trainer))]

    async def _drain(self) -> None:
        try:
            while self._ready():
                for taken in await self._next_passes():
                    await self._train_pass(taken)
        finally:
            self._drainer = None

    async def _train_pass(self, taken: list[_Request]) -> None:
        """Validates ``taken`` (an invalid batch fails its tenant alone) and trains the valid ones in one pass."""
        valid = []
        for request in taken:
            try:
                validate_batch(request.batch)
                valid.append(request)
            except ValueError as error:
                # No pass runs now: give back the slot it may have been prefetched into.
                slot = self.trainer.store.slot_of(request.tenant)
                if slot is not None:
                    self.trainer.store.release(slot)
                _fail(request, error)
        if valid:
            await self._run(valid)

    async def _run(self, requests: list[_Request]) -> None:
        for request in requests:
            self._updates[request.tenant] = self._updates.get(request.tenant, 0) + 1
        try:
            if self.mode == "packed":
                results = await asyncio.to_thread(self._pass, requests, self.trainer.train_packed,
                                                  [(r.tenant, r.batch) for r in requests])
            else:
                upcoming = self._first().tenant if self._waiting else None
                results = [await asyncio.to_thread(self._pass, requests, self.trainer.train_step, requests[0].tenant,
                                                   requests[0].batch, upcoming)]
        except Exception as error:  # noqa: BLE001 - the pass's tenants fail, the scheduler keeps serving the others
            for request in requests:
                _fail(request, error)
            return
        for request, (weights, metrics) in zip(requests, results):
            if not request.result.done():  # done: its tenant's task was cancelled meanwhile
                request.result.set_result((weights, {**metrics, "pass_tenants": float(len(requests))}))

    def _pass(self, requests: list[_Request], train: Callable[..., Result], *args) -> Result:
        """Runs one training call for ``requests`` (on a worker thread), with sampling paused around it when there is
        a sampler decoding at least ``pause_rows`` rows; records it in :attr:`passes`."""
        started = time.perf_counter()
        rows = None if self.sampler is None else self.sampler.running_rows()
        pause = rows is not None and rows >= self.pause_rows
        if pause:
            self.sampler.pause()
        try:
            return train(*args)
        finally:
            if pause:
                self.sampler.resume()
            self.passes.append(TrainPass(tuple(r.tenant for r in requests), tuple(r.arrived for r in requests),
                                         started, time.perf_counter(), pause, rows))


def pack_cost_model(trainer: Trainer) -> PackCostModel:
    """The pack planner's cost model of ``trainer``'s passes: its micro-batch bounds, shared prompts, policy
    mini-batches and epochs; every slot computes at the store's max rank."""
    return PackCostModel(micro_batch_size=trainer.micro_batch_size, max_tokens=trainer.max_tokens_per_microbatch,
                         shared_prompts=trainer.shared_prefix, mini_batch_prompts=trainer.mini_batch_prompts,
                         update_epochs=trainer.update_epochs, slot_rank=trainer.store.max_rank)


def _fail(request: _Request, error: Exception) -> None:
    if not request.result.done():
        request.result.set_exception(error)
