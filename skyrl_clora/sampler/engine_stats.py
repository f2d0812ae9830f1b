"""The sampling engine's counters (``Engine.stats``): where its thread's time and tokens went, and the recorder
(:class:`StatsRecorder`) that the engine and its thread report their events to."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class EngineStats:
    """Counters since start: decode steps, admission rounds that prefilled (one batched prefill call
    each), tokens generated, prompt tokens computed by prefill and prompt tokens served from the prefix
    cache, seconds spent in prefill (with its sampling and first-use graph captures), in decode steps (with
    their sampling) and busy in all, the seconds the loop waited while paused and while it had nothing to do
    (no running row, request or publish; busy + paused + idle is the engine thread's lifetime, up to the
    loop's own bookkeeping; a wait counts by the state it began in, and the first pause ends a wait, so the
    time after it counts as paused; idle waits of 1 ms or more are counted and the longest kept, a wait ending
    at the first request, publish or pause, or after 0.5 s), the seconds decode steps waited for their sampled
    tokens (for the step's GPU work: the rest of a decode step is host work, done while the GPU runs the next
    step), of the rest the seconds decode steps spent staging their inputs (choosing rows, shared-prefix
    sources, copies to the device) and launching the step and its sampling (a CUDA-graph replay, or the eager
    forward on the CPU), the GPU time of the decode steps' forward passes (:class:`GPUSpan` around each; 0
    off CUDA: set against decode_seconds per step it tells a GPU-bound step from one whose GPU idles or is
    shared), likewise the GPU time of the prefill rounds' forward passes and, apart, of their copies of shared
    blocks a row writes into and block-table uploads, the seconds spent retiring finished requests (keeping
    their blocks as a history, completing their futures; in decode steps and prefill), the seconds the decode
    CUDA graphs' capture took, the key positions decode steps read through another row's shared blocks, the
    preemptions, the peaks of running requests and of KV blocks held, and the adapter slots' cache: admissions of
    requests whose adapter held its device slot (hits), adapters written into a slot for an admission (loads) and
    loads into a slot taken from another adapter (evictions); :attr:`adapter_hit_rate` is hits over hits and
    loads."""

    decode_steps: int = 0
    prefill_rounds: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_wait_seconds: float = 0.0
    decode_input_seconds: float = 0.0
    decode_launch_seconds: float = 0.0
    decode_gpu_seconds: float = 0.0
    prefill_gpu_seconds: float = 0.0
    prefill_copy_gpu_seconds: float = 0.0
    retire_seconds: float = 0.0
    busy_seconds: float = 0.0
    paused_seconds: float = 0.0
    idle_seconds: float = 0.0
    idle_waits: int = 0
    longest_idle_seconds: float = 0.0
    graph_capture_seconds: float = 0.0
    shared_prefix_positions: int = 0  # decode-step key positions read through another row's shared blocks
    preemptions: int = 0  # running requests stopped for want of a KV block (queued again to start over)
    peak_running_rows: int = 0  # most requests running at once
    peak_blocks_held: int = 0  # most KV blocks held by rows and histories at once (sampled after prefill rounds)
    adapter_hits: int = 0  # admissions whose adapter held its device slot
    adapter_loads: int = 0  # adapters written into a device slot for an admission
    adapter_evictions: int = 0  # loads into a slot taken from another (idle) adapter

    @property
    def adapter_hit_rate(self) -> float:
        """The share of admissions (with an adapter) that found it in its slot (1.0 before any)."""
        admissions = self.adapter_hits + self.adapter_loads
        return self.adapter_hits / admissions if admissions else 1.0


class GPUSpan:
    """CUDA events around the work a ``with`` block queues on the current stream (nothing off CUDA);
    :meth:`seconds` is that work's GPU time, once it has run."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None

    def __enter__(self) -> GPUSpan:
        if self._events is not None:
            self._events[0].record()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._events is not None:
            self._events[1].record()

    def seconds(self) -> float:
        """The span's GPU seconds (waits for its end event; 0.0 off CUDA)."""
        if self._events is None:
            return 0.0
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3

    def offsets(self, base: torch.cuda.Event) -> tuple[float, float]:
        """Seconds from ``base`` (a completed event) to the span's start and end on the GPU (waits for its end)."""
        self._events[1].synchronize()
        return base.elapsed_time(self._events[0]) / 1e3, base.elapsed_time(self._events[1]) / 1e3


class GPUTimeline:
    """The GPU intervals of the spans :meth:`add` is given, on the host clock (``time.perf_counter()`` seconds):
    ``intervals[i] = (start, end)``. The clocks are tied by one event recorded with ``device`` idle (CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record()
        self._base.synchronize()
        self._host = time.perf_counter()
        self.intervals: list[tuple[float, float]] = []

    def add(self, span: GPUSpan) -> None:
        """Appends ``span``'s interval (waits for its end)."""
        start, end = span.offsets(self._base)
        self.intervals.append((self._host + start, self._host + end))


class StatsRecorder:
    """Turns the engine's and its thread's events into the counters of ``stats`` (an :class:`EngineStats`) and,
    from :meth:`record_gpu_intervals` on, the GPU spans of its passes into ``timeline``. The timer arguments are
    ``time.perf_counter()`` readings taken by the caller; a method reads the clock itself only for the end of
    the span it records. Called on the engine thread (or the thread driving :meth:`Engine.step`); besides the
    counters it keeps each finished request's queue wait by tenant (:meth:`queue_waits`, read from any thread)."""

    def __init__(self, device: torch.device) -> None:
        self.stats = EngineStats()
        self.timeline: GPUTimeline | None = None
        self._device = device
        self._waits: dict[str, list[float]] = {}
        self._waits_lock = threading.Lock()

    def record_gpu_intervals(self) -> GPUTimeline:
        """From now on, the GPU interval of every decode step's forward pass and prefill round's copies and forward
        pass, on the host clock, in the returned timeline (CUDA only)."""
        self.timeline = GPUTimeline(self._device)
        return self.timeline

    def graphs_captured(self, seconds: float) -> None:
        self.stats.graph_capture_seconds = seconds

    def row_started(self, running_rows: int) -> None:
        """A request started running; ``running_rows`` run now."""
        self.stats.peak_running_rows = max(self.stats.peak_running_rows, running_rows)

    def prefill_launched(self, started: float, computed: int, cached: int, held_blocks: int) -> None:
        """A prefill round (begun at ``started``) launched: ``computed`` prompt tokens computed, ``cached`` taken
        from the prefix cache or histories; ``held_blocks`` KV blocks held after it."""
        stats = self.stats
        stats.prefill_rounds += 1
        stats.prefill_tokens += computed
        stats.cached_prompt_tokens += cached
        stats.peak_blocks_held = max(stats.peak_blocks_held, held_blocks)
        stats.prefill_seconds += time.perf_counter() - started

    def prefill_accepted(self, started: float, forward: GPUSpan, copied: GPUSpan) -> None:
        """A prefill round's first tokens (waited for from ``started``) accepted; its GPU spans."""
        self.stats.prefill_gpu_seconds += forward.seconds()
        self.stats.prefill_copy_gpu_seconds += copied.seconds()
        self._on_timeline(copied, forward)
        self.stats.prefill_seconds += time.perf_counter() - started

    def decode_launched(self, started: float, staged: float, launched: float, shared_positions: int) -> None:
        """A decode step launched: begun at ``started``, its inputs staged at ``staged``, its forward pass and
        sampling queued at ``launched``; ``shared_positions`` key positions read through another row's blocks."""
        stats = self.stats
        stats.shared_prefix_positions += shared_positions
        stats.decode_input_seconds += staged - started
        stats.decode_launch_seconds += launched - staged
        stats.decode_steps += 1
        stats.decode_seconds += launched - started

    def decode_accepted(self, started: float, received: float, forward: GPUSpan) -> None:
        """A decode step's tokens, waited for from ``started`` until ``received``, accepted; its forward pass's span."""
        self.stats.decode_wait_seconds += received - started
        self.stats.decode_gpu_seconds += forward.seconds()
        self._on_timeline(forward)
        self.stats.decode_seconds += time.perf_counter() - started

    def tokens_accepted(self, count: int, retiring: float) -> None:
        """``count`` tokens accepted, the finished requests retired from ``retiring`` until now."""
        self.stats.generated_tokens += count
        self.stats.retire_seconds += time.perf_counter() - retiring

    def adapters_scheduled(self, hits: int, loads: int, evictions: int) -> None:
        """An admission round: ``hits`` requests found their adapter in its slot, ``loads`` adapters were given one,
        ``evictions`` of them another adapter's."""
        self.stats.adapter_hits += hits
        self.stats.adapter_loads += loads
        self.stats.adapter_evictions += evictions

    def request_finished(self, adapter: str | None, waited: float) -> None:
        """A request of ``adapter`` (None: the base model, not counted) finished; it waited ``waited`` seconds from
        its submission to the admission it finished from (a preempted request's wait includes its first runs)."""
        if adapter is not None:
            with self._waits_lock:
                self._waits.setdefault(adapter, []).append(waited)

    def queue_waits(self) -> dict[str, dict[str, float]]:
        """Per tenant (adapter name, sorted) over its finished requests: ``requests``, the ``p50_s``, ``p99_s`` and
        ``max_s`` of their queue waits and their sum ``total_s``, in seconds (:meth:`request_finished`)."""
        with self._waits_lock:
            waits = {tenant: np.array(values) for tenant, values in sorted(self._waits.items())}
        return {tenant: {"requests": int(values.size), "p50_s": float(np.percentile(values, 50)),
                         "p99_s": float(np.percentile(values, 99)), "max_s": float(values.max()),
                         "total_s": float(values.sum())}
                for tenant, values in waits.items()}

    def preempted(self, count: int) -> None:
        self.stats.preemptions += count

    def waited(self, seconds: float, paused: bool, idle: bool) -> None:
        """The engine thread waited ``seconds`` for its inbox, while ``paused`` or ``idle`` (else neither: busy)."""
        if paused:
            self.stats.paused_seconds += seconds
        elif idle:
            self.stats.idle_seconds += seconds
            self.stats.idle_waits += seconds >= 1e-3
            self.stats.longest_idle_seconds = max(self.stats.longest_idle_seconds, seconds)

    def busy(self, seconds: float) -> None:
        """The engine thread worked ``seconds`` (a round, or the end of the step in flight before a pause)."""
        self.stats.busy_seconds += seconds

    def _on_timeline(self, *spans: GPUSpan) -> None:
        if self.timeline is not None:
            for span in spans:
                self.timeline.add(span)
