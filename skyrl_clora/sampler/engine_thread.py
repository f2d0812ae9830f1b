"""The sampling engine's background thread: the engine's thread-safe API, its inbox, nesting pauses and the time
it counts busy, idle or paused.

:class:`EngineThread` holds an :class:`~skyrl_clora.sampler.engine.Engine` and runs its rounds
(:meth:`Engine.step`) on one thread of its own, which alone touches the model and the engine's state; other
threads talk to it through the inbox (requests, publishes, unregisters; ``None`` only wakes it) and
:meth:`~EngineThread.pause` / :meth:`~EngineThread.resume`. Building an :class:`EngineThread` starts the thread:
there is no engine thread that is built but not started.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import sys
import threading
import time

import torch

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import STREAM_PRIORITIES
from skyrl_clora.sampler.engine_stats import EngineStats, GPUTimeline
from skyrl_clora.sampler.requests import Publish, QueuedRequest, SamplingParams, Unregister

GIL_SWITCH_SECONDS = 0.0005  # the GIL switch interval while the engine runs on a GPU (Python's default: 5 ms)


class EngineThread:
    """Runs ``engine`` on a thread started here (on a GPU, on a CUDA stream of its own at the engine's
    ``config.stream_priority``) until :meth:`shutdown`. Thread-safe: every public method may be called from any
    thread; ``submit`` and ``publish`` return ``concurrent.futures.Future`` objects. ``engine`` is for reading
    (``adapters``, ``recorder``) and for tests; its rounds belong to the thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_len = engine.max_len  # positions per request (prompt and completion)
        self._inbox: queue.Queue = queue.Queue()
        self._paused = threading.Event()  # set while _pauses > 0
        self._pauses = 0
        self._pause_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="clora-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        """The engine's counters (a live view)."""
        return self.engine.stats

    def queue_waits(self) -> dict[str, dict[str, float]]:
        """Each tenant's queue waits over its finished requests
        (:meth:`~skyrl_clora.sampler.engine_stats.StatsRecorder.queue_waits`)."""
        return self.engine.recorder.queue_waits()

    def register_adapter(self, name: str, weights: AdapterWeights, version: int = 0) -> None:
        """Registers ``name`` with ``weights`` as its ``version`` (before any request of it is submitted); returns once
        the engine holds them. It takes a device slot when a request of it is admitted."""
        self.engine.adapters.register(name)
        self.publish(name, weights, version).result()

    def unregister_adapter(self, name: str) -> concurrent.futures.Future:
        """Drops ``name`` (its host copy, and its slot if it holds one) once none of its requests is running; its
        waiting requests fail. Resolves when it is dropped."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if name not in self.engine.adapters:
            future.set_exception(ValueError(f"unknown adapter {name!r}"))
            return future
        self._inbox.put(Unregister(name, future))
        return future

    def adapter_version(self, name: str) -> int:
        """The published version of ``name`` (``AdapterSlots.version``)."""
        return self.engine.adapters.version(name)

    def submit(self, prompt_ids: list[int], adapter: str | None, params: SamplingParams) -> concurrent.futures.Future:
        """Queues one generation request; the future resolves to a :class:`~skyrl_clora.sampler.requests.Completion`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        adapters = self.engine.adapters
        if adapter is not None and adapter not in adapters:
            future.set_exception(ValueError(f"unknown adapter {adapter!r}; registered: {adapters.names()}"))
            return future
        if not prompt_ids or len(prompt_ids) >= self.max_len:
            future.set_exception(
                ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the engine's max_len {self.max_len}")
            )
            return future
        self._inbox.put(QueuedRequest(list(prompt_ids), adapter, params, future))
        return future

    def publish(self, adapter: str, weights: AdapterWeights, version: int) -> concurrent.futures.Future:
        """Queues ``weights`` as ``adapter``'s ``version``: its host copy (``AdapterSlots.host_copy``, made here on the
        caller's thread) and, if it holds one, its device slot in place; resolves once applied."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if adapter not in self.engine.adapters:
            future.set_exception(ValueError(f"unknown adapter {adapter!r}"))
            return future
        self._inbox.put(Publish(adapter, self.engine.adapters.host_copy(weights), version, future))
        return future

    def running_rows(self) -> int:
        """How many requests hold a row now (a snapshot)."""
        return self.engine.running_rows()

    def record_gpu_intervals(self) -> GPUTimeline:
        """From now on, the GPU intervals of the engine's passes in the returned timeline
        (:meth:`~skyrl_clora.sampler.engine_stats.StatsRecorder.record_gpu_intervals`; CUDA only)."""
        return self.engine.recorder.record_gpu_intervals()

    def pause(self) -> None:
        """Stops stepping after the step in flight (requests keep their state) until :meth:`resume`. Pauses
        nest: the engine steps again once every :meth:`pause` has had its :meth:`resume`. The first pause
        wakes an idle engine thread, so that its stats count the time from then on as paused, not idle."""
        with self._pause_lock:
            self._pauses += 1
            self._paused.set()
            if self._pauses == 1:
                self._inbox.put(None)

    def resume(self) -> None:
        """Ends one :meth:`pause`."""
        with self._pause_lock:
            if self._pauses == 0:
                raise RuntimeError("EngineThread.resume() without a pause()")
            self._pauses -= 1
            if self._pauses == 0:
                self._paused.clear()
                self._inbox.put(None)

    def shutdown(self) -> None:
        """Stops the engine thread after its current round and waits for it."""
        self._stop.set()
        self._inbox.put(None)
        self._thread.join()

    # ---- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        """The engine thread. On a GPU all its work runs on its own CUDA stream: the trainer's kernels (on the
        default stream of another thread) then overlap with decode steps instead of queueing before them, and
        a step's host synchronisation waits for the engine's own work only. At ``stream_priority="high"`` the
        GPU schedules a decode step's blocks ahead of waiting training blocks (a tenant's rollout is slowed as
        little as possible by another tenant's training; RESULTS.md, Engine and trainer settings and why); at
        ``"normal"`` neither goes first. The engine shares only read-only base
        weights with the trainer; adapters arrive as host tensors.

        The thread also lowers the interpreter's GIL switch interval (process-wide) to
        :data:`GIL_SWITCH_SECONDS` on a GPU: it takes the GIL back after every host synchronisation, and with
        Python's default of 5 ms a decode step of about that length could wait as long again behind the
        trainer's (Python-heavy, eager) thread."""
        stream = None
        device = self.engine.runner.device
        if device.type == "cuda":
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_SECONDS))
            torch.cuda.synchronize(device)  # the buffers built on the default stream are ready
            stream = torch.cuda.Stream(device, priority=STREAM_PRIORITIES[self.engine.config.stream_priority])
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._serve()

    def _serve(self) -> None:
        engine, recorder = self.engine, self.engine.recorder
        while not self._stop.is_set():
            in_flight = engine.has_step_in_flight()
            idle = not in_flight and engine.scheduler.idle()
            paused = self._paused.is_set()
            began = time.perf_counter()
            self._drain_inbox(block=(idle or paused) and not in_flight)
            recorder.waited(time.perf_counter() - began, paused, idle)
            stepping = not (self._paused.is_set() or self._stop.is_set())
            if not stepping and not engine.has_step_in_flight():
                continue
            started = time.perf_counter()
            try:
                if stepping:
                    engine.step()
                else:  # the step in flight ends before the pause
                    engine.finish_step_in_flight()
            except Exception as error:  # a broken step fails its requests, not the engine thread
                engine.fail(error)
            recorder.busy(time.perf_counter() - started)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:  # None only wakes the thread
                self.engine.scheduler.enqueue(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
