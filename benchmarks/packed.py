"""Packed LoRA training for ``benchmarks.kernels``: forward + backward of the LoRA part of N adapters in one pass
against the adapters one after another, and the same under launch-config variants of the packed kernels
(``--packed-sweep``)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import DEVICE, DT, graph_time, sync
from skyrl_clora.kernels import LoRAMeta
from skyrl_clora.kernels.lora.packed import PackedConfig, packed_lora_triton


class PackedCase:
    """Packed training's inputs: ``n`` adapters of rank ``r``, ``t`` tokens in all (``t // n`` each, contiguous),
    hidden ``h`` in and out; forward + backward of the LoRA part, packed in one pass (``packed_lora_triton``
    under a launch config) or the adapters one after another (plain torch autograd)."""

    def __init__(self, n: int = 8, r: int = 16, t: int = 4096, h: int = 4096) -> None:
        self.N, self.R, self.T, self.H = n, r, t, h
        self.per = t // n
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        self.x = torch.randn(t, h, device=DEVICE, dtype=DT, generator=gen, requires_grad=True)
        self.a = (torch.randn(n, r, h, device=DEVICE, dtype=DT, generator=gen) / h**0.5).requires_grad_()
        self.b = torch.randn(n, h, r, device=DEVICE, dtype=DT, generator=gen).requires_grad_()
        self.dy = torch.randn(t, h, device=DEVICE, dtype=DT, generator=gen)
        self.scales = torch.full((n,), 2.0, device=DEVICE)
        self.slots = torch.arange(n, device=DEVICE).repeat_interleave(self.per)
        self.meta = LoRAMeta(max_tokens=t, num_slots=n, device=DEVICE, max_rank=r)
        self.meta.build(self.slots)
        self.xs = [self.x.detach()[i * self.per : (i + 1) * self.per].clone().requires_grad_() for i in range(n)]
        self.as_ = [self.a.detach()[i].clone().requires_grad_() for i in range(n)]
        self.bs = [self.b.detach()[i].clone().requires_grad_() for i in range(n)]

    def packed(self, config: PackedConfig | None = None) -> Callable[[], None]:
        def run() -> None:
            y = packed_lora_triton(self.x, self.a, self.b, self.scales, self.slots, meta=self.meta, config=config)
            torch.autograd.grad(y, (self.x, self.a, self.b), self.dy)

        return run

    def packed_forward(self, config: PackedConfig | None = None) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                packed_lora_triton(self.x, self.a, self.b, self.scales, self.slots, meta=self.meta, config=config)

        return run

    def sequential(self) -> None:
        for i in range(self.N):
            y = (self.xs[i] @ self.as_[i].T) @ self.bs[i].T * 2.0
            torch.autograd.grad(y, (self.xs[i], self.as_[i], self.bs[i]), self.dy[i * self.per : (i + 1) * self.per])

    def sequential_forward(self) -> None:
        with torch.no_grad():
            for i in range(self.N):
                (self.xs[i] @ self.as_[i].T) @ self.bs[i].T * 2.0


def packed_training(results: dict, bandwidth: float, case: PackedCase) -> list[str]:
    """``case``: packed vs the adapters one after another, in CUDA graphs and eagerly, and the memory
    floor: the bytes of forward + backward (``x`` read twice, ``y`` written, ``dy`` read, ``dx`` written:
    five ``[T, H]`` tensors) over ``bandwidth`` (the copy bandwidth, read + write)."""

    def eager(fn: Callable[[], None]) -> float:
        for _ in range(3):
            fn()
        sync()
        times = []
        for _ in range(20 if DEVICE == "cuda" else 1):  # the CPU's smoke run times one call
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    res = {
        "packed_graph_s": graph_time([case.packed()], min_calls=10),
        "sequential_graph_s": graph_time([case.sequential], min_calls=10),
        "packed_eager_s": eager(case.packed()),
        "sequential_eager_s": eager(case.sequential),
        "packed_forward_graph_s": graph_time([case.packed_forward()], min_calls=10),
        "sequential_forward_graph_s": graph_time([case.sequential_forward], min_calls=10),
        "floor_s": 5 * case.x.numel() * case.x.element_size() / bandwidth,
    }
    results["packed"] = res
    return [
        f"| packed training, N={case.N} r={case.R} T={case.T} hidden {case.H} | packed us | {case.N} adapters one after "
        "another us | speed-up |",
        "| --- | --- | --- | --- |",
        f"| CUDA graph replay | {res['packed_graph_s'] * 1e6:.1f} | {res['sequential_graph_s'] * 1e6:.1f} | "
        f"{res['sequential_graph_s'] / res['packed_graph_s']:.1f}x |",
        f"| eager (host launch overhead included) | {res['packed_eager_s'] * 1e6:.1f} | "
        f"{res['sequential_eager_s'] * 1e6:.1f} | {res['sequential_eager_s'] / res['packed_eager_s']:.1f}x |",
        f"| forward only, CUDA graph replay | {res['packed_forward_graph_s'] * 1e6:.1f} | "
        f"{res['sequential_forward_graph_s'] * 1e6:.1f} | "
        f"{res['sequential_forward_graph_s'] / res['packed_forward_graph_s']:.1f}x |",
        f"| memory floor (5 x {case.T}x{case.H} {DT} at the copy bandwidth) | {res['floor_s'] * 1e6:.1f} | | "
        f"packed at {res['packed_graph_s'] / res['floor_s']:.2f}x the floor |",
    ]


SMOKE_PACKED = {"n": 2, "r": 8, "t": 32, "h": 64}  # ``benchmarks.kernels --smoke``'s case

# ``--packed-sweep``'s configs, as changes to ``PackedConfig()``'s defaults (the defaults first): one kernel's
# shape at a time, so that each config compiles one or two new kernels.
PACKED_SWEEP: list[dict[str, int | None]] = [
    {},
    {"fwd_rows": 16}, {"fwd_warps": 8}, {"fwd_rows": 16, "fwd_warps": 8}, {"fwd_block_n": 128}, {"fwd_block_k": 256},
    {"fwd_stages": 3},
    {"dy_rows": 64}, {"dy_rows": 64, "dy_stages": 4}, {"dy_stages": 2}, {"dy_block_n": 256}, {"dy_block_n": 64},
    {"dy_warps": 8}, {"dy_warps": 8, "dy_maxnreg": 128},
    {"x_rows": 64}, {"x_rows": 16}, {"x_block_k": 128}, {"x_block_k": 512}, {"x_warps": 8}, {"x_stages": 3},
    {"x_maxnreg": 96},
    {"x_target_programs": 128}, {"dy_target_programs": 512, "x_target_programs": 512}, {"dy_maxnreg": 64, "x_maxnreg": 64},
]


def packed_sweep(results: dict, changes: list[dict[str, int | None]]) -> list[str]:
    """``PackedCase`` under each of ``changes`` to the default ``PackedConfig``: forward + backward and forward
    alone by CUDA-graph replay, against the adapters one after another (timed once)."""
    case = PackedCase()
    sequential = graph_time([case.sequential], min_calls=10)
    results["packed_sweep"] = {"sequential_graph_s": sequential, "configs": []}
    lines = [
        f"packed training sweep, N={case.N} r={case.R} T={case.T} hidden {case.H}; {case.N} adapters one after another: "
        f"{sequential * 1e6:.1f} us",
        "",
        "| config (changes to the defaults) | fwd+bwd us | forward us | difference us | speed-up vs sequential |",
        "| --- | --- | --- | --- | --- |",
    ]
    for change in changes:
        label = ", ".join(f"{k}={v}" for k, v in change.items()) or "default"
        row: dict = {"changes": change}
        try:
            config = PackedConfig(**change)
            row["config"] = dataclasses.asdict(config)
            row["graph_s"] = graph_time([case.packed(config)], min_calls=10)
            row["forward_graph_s"] = graph_time([case.packed_forward(config)], min_calls=10)
            lines.append(f"| {label} | {row['graph_s'] * 1e6:.1f} | {row['forward_graph_s'] * 1e6:.1f} | "
                         f"{(row['graph_s'] - row['forward_graph_s']) * 1e6:.1f} | {sequential / row['graph_s']:.2f}x |")
        except Exception as e:  # a failed config (e.g. out of shared memory) is reported, the others still run
            row["error"] = repr(e)
            lines.append(f"| {label} | error: {e!r} | | | |")
        results["packed_sweep"]["configs"].append(row)
        print(lines[-1], flush=True)
    return lines
