"""The sampling engine's background thread: its inbox, nesting pauses and the time it counts busy, idle or paused.

:class:`EngineThread` runs a subclass's rounds (:meth:`EngineThread.step`) on one thread of its own, which alone
touches the model and the engine's state; other threads talk to it through the inbox (requests, publishes,
unregisters; ``None`` only wakes it) and :meth:`~EngineThread.pause` / :meth:`~EngineThread.resume`.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from typing import Any

import torch

from skyrl_clora.sampler.engine_stats import EngineStats

GIL_SWITCH_SECONDS = 0.0005  # the GIL switch interval while the engine runs on a GPU (Python's default: 5 ms)
# The engine stream's CUDA priority by name (lower is higher; the trainer's default streams are at 0).
STREAM_PRIORITIES = {"high": -1, "normal": 0}


class EngineThread:
    """The engine's thread and its inbox. A subclass sets ``stats`` and calls :meth:`start_thread` last in its
    ``__init__``; it implements :meth:`step` (one round of work), :meth:`_enqueue` (takes an inbox item),
    :meth:`_idle` (nothing waits and nothing runs), :meth:`_has_step_in_flight` (a launched step's tokens are not
    accepted yet), :meth:`_finish_step_in_flight` (accepts them) and :meth:`_fail_steps` (fails what a broken
    round leaves running); all run on the engine thread."""

    stats: EngineStats

    def start_thread(self, device: torch.device, stream_priority: str) -> None:
        """Starts the engine thread on ``device`` (on a GPU, on a CUDA stream of its own at ``stream_priority``,
        a key of :data:`STREAM_PRIORITIES`)."""
        if stream_priority not in STREAM_PRIORITIES:
            raise ValueError(f"stream_priority={stream_priority!r} is unknown; use one of {sorted(STREAM_PRIORITIES)}")
        self.stream_priority = stream_priority
        self._inbox: queue.Queue = queue.Queue()
        self._paused = threading.Event()  # set while _pauses > 0
        self._pauses = 0
        self._pause_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(device,), name="clora-engine", daemon=True)
        self._thread.start()

    # ---- subclass hooks (engine thread) -------------------------------------------------------

    def step(self) -> None:
        raise NotImplementedError

    def _enqueue(self, item: Any) -> None:
        raise NotImplementedError

    def _idle(self) -> bool:
        raise NotImplementedError

    def _has_step_in_flight(self) -> bool:
        raise NotImplementedError

    def _finish_step_in_flight(self) -> None:
        raise NotImplementedError

    def _fail_steps(self, error: Exception) -> None:
        raise NotImplementedError

    # ---- any thread -----------------------------------------------------------------------------

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
        with self._pause_lock:
            if self._pauses == 0:
                raise RuntimeError("Engine.resume() without a pause()")
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

    def _loop(self, device: torch.device) -> None:
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
        if device.type == "cuda":
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_SECONDS))
            torch.cuda.synchronize(device)  # the buffers built on the default stream are ready
            stream = torch.cuda.Stream(device, priority=STREAM_PRIORITIES[self.stream_priority])
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._serve()

    def _serve(self) -> None:
        while not self._stop.is_set():
            in_flight = self._has_step_in_flight()
            idle = not in_flight and self._idle()
            paused = self._paused.is_set()
            began = time.perf_counter()
            self._drain_inbox(block=(idle or paused) and not in_flight)
            waited = time.perf_counter() - began
            if paused:
                self.stats.paused_seconds += waited
            elif idle:
                self.stats.idle_seconds += waited
                self.stats.idle_waits += waited >= 1e-3
                self.stats.longest_idle_seconds = max(self.stats.longest_idle_seconds, waited)
            stepping = not (self._paused.is_set() or self._stop.is_set())
            if not stepping and not self._has_step_in_flight():
                continue
            started = time.perf_counter()
            try:
                if stepping:
                    self.step()
                else:  # the step in flight ends before the pause
                    self._finish_step_in_flight()
            except Exception as error:  # a broken step fails its requests, not the engine thread
                self._fail_steps(error)
            self.stats.busy_seconds += time.perf_counter() - started

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:  # None only wakes the thread
                self._enqueue(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
