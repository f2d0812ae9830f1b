"""The sampling engine's counters (``Engine.stats``): where its thread's time and tokens went."""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    preemptions, and the peaks of running requests and of KV blocks held."""

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
