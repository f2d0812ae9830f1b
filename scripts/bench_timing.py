"""Timing helpers shared by the GPU benchmarks: CUDA-graph replay timing with inputs rotated past the L2, a
clock warm-up, and the device's copy bandwidth (the rooflines' denominator)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

DT = torch.bfloat16  # the benchmarks' dtype
L2_BYTES = 60 * 2**20  # an H200's L2 is 50 MiB: inputs rotated over 3x this miss it


def graph_time(calls: list[Callable[[], None]], min_calls: int = 20) -> float:
    """Seconds per call: the calls (one per input set, cycled to at least ``min_calls``, fewer for slow
    calls) captured in one CUDA graph; median over replays."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    n = max(len(calls), min(min_calls, math.ceil(2e-3 / est)))
    seq = [calls[i % len(calls)] for i in range(n)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in seq[: len(calls)]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in seq:
            c()
    reps = max(5, min(30, int(0.15 / (est * n))))
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / n)
    del graph
    return statistics.median(times)


def warm_up(seconds: float = 2.0) -> None:
    """Keeps the GPU busy with bf16 matrix products so its clocks are up before anything is timed."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy by a kernel (``torch.add(src, 0, out=dst)``),
    counting bytes read plus bytes written. Not ``dst.copy_(src)``: captured in a CUDA graph that becomes a
    memcpy node, which the copy engines run at ~2.7 TB/s on the H200 against ~4.3 TB/s for a kernel
    (RESULTS.md, Method), and kernels are what the rooflines compare."""
    src = torch.randn(2**30, device="cuda")
    dst = torch.empty_like(src)
    t = graph_time([lambda: torch.add(src, 0.0, out=dst)], min_calls=5)
    return 2 * src.numel() * 4 / t
