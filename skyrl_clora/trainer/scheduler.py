"""The train scheduler: tenant loops hand it their batches; it runs the trainer, one pass at a time, off the
event loop.

- swap mode: the waiting tenants train one at a time in arrival order; while one trains, the next waiting
  tenant's state is prefetched into the trainer's second slot (``Trainer.train_step(..., prefetch=)``).
- packed mode: whenever the trainer is free, every waiting tenant (up to ``trainer.pack_size``, in arrival
  order) trains in one packed pass (``Trainer.train_packed``).
A tenant whose batch is invalid fails alone (its ``train`` call raises); if a pass itself raises, the
tenants of that pass fail and the others keep going.

Given a ``sampler`` to pause (the engine), a pass that starts while at least ``pause_rows`` of its rows are
decoding runs with sampling paused, so the GPU runs one workload at a time instead of sharing itself between
a training pass and a full decode batch; with fewer rows decoding (a long-tailed step's last episodes), the
pass runs beside them and fills the GPU they leave idle. ``pause_rows=0`` pauses for every pass
(``trainer.overlap_sampling=false``); no sampler never pauses (``true``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.trainer.batch import TrainBatch, validate_batch
from skyrl_clora.trainer.trainer import Trainer

TRAIN_MODES = ("swap", "packed")
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


class TrainScheduler:
    """Queues ``(tenant, batch)`` requests and drains them through ``trainer`` in ``mode`` (swap or packed);
    with ``sampler``, sampling is paused for each pass that starts while at least ``pause_rows`` rows decode.
    ``pass_seconds``: the passes' time so far (with the pauses around them); ``paused_passes``: how many
    passes paused sampling."""

    def __init__(self, trainer: Trainer, mode: str, sampler: PausableSampler | None = None, pause_rows: int = 0) -> None:
        if mode not in TRAIN_MODES:
            raise ValueError(f"train mode {mode!r} is unknown; use swap or packed")
        self.trainer = trainer
        self.mode = mode
        self.sampler = sampler
        self.pause_rows = pause_rows
        self.pass_seconds = 0.0
        self.paused_passes = 0
        self._waiting: list[_Request] = []
        self._drainer: asyncio.Task | None = None

    async def train(self, tenant: str, batch: TrainBatch) -> tuple[AdapterWeights, dict[str, float]]:
        """Trains ``tenant`` on ``batch`` in the next pass that has room; returns its new weights and metrics
        (``pass_tenants``: how many tenants shared the pass)."""
        request = _Request(tenant, batch, asyncio.get_running_loop().create_future())
        self._waiting.append(request)
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        return await request.result

    async def _drain(self) -> None:
        try:
            while self._waiting:
                size = self.trainer.pack_size if self.mode == "packed" else 1
                taken, self._waiting = self._waiting[:size], self._waiting[size:]
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
        finally:
            self._drainer = None

    async def _run(self, requests: list[_Request]) -> None:
        try:
            if self.mode == "packed":
                results = await asyncio.to_thread(self._pass, self.trainer.train_packed, [(r.tenant, r.batch) for r in requests])
            else:
                upcoming = self._waiting[0].tenant if self._waiting else None
                results = [await asyncio.to_thread(self._pass, self.trainer.train_step, requests[0].tenant, requests[0].batch,
                                                   upcoming)]
        except Exception as error:  # noqa: BLE001 - the pass's tenants fail, the scheduler keeps serving the others
            for request in requests:
                _fail(request, error)
            return
        for request, (weights, metrics) in zip(requests, results):
            if not request.result.done():  # done: its tenant's task was cancelled meanwhile
                request.result.set_result((weights, {**metrics, "pass_tenants": float(len(requests))}))

    def _pass(self, train: Callable[..., Result], *args) -> Result:
        """Runs one training call (on a worker thread), with sampling paused around it when there is a sampler
        decoding at least ``pause_rows`` rows."""
        started = time.perf_counter()
        pause = self.sampler is not None and self.sampler.running_rows() >= self.pause_rows
        if pause:
            self.sampler.pause()
            self.paused_passes += 1
        try:
            return train(*args)
        finally:
            if pause:
                self.sampler.resume()
            self.pass_seconds += time.perf_counter() - started


def _fail(request: _Request, error: Exception) -> None:
    if not request.result.done():
        request.result.set_exception(error)
