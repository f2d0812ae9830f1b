"""CUDA settings the trainer relies on: cuDNN attention off, and optionally a stream on a subset of the SMs.

PyTorch's scaled_dot_product_attention prefers cuDNN's attention on Hopper, and cuDNN builds an execution
graph for every new combination of shapes (tens to hundreds of milliseconds, then cached per shape). The
trainer's micro-batches change their batch and sequence lengths all the time (so did the engine's prefill
passes when they called SDPA: a prefill round cost ~120-150 ms on the H200 whatever it computed,
BENCHMARKS.md, fourth session). Flash and memory-efficient attention have no per-shape set-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.cuda import green_contexts

# Hopper's SM granularity for a green context: groups of 8 SMs (CUDA driver API, cuDevSmResourceSplitByCount).
GREEN_CONTEXT_SM_GRANULE = 8


def avoid_cudnn_attention() -> None:
    """Turns cuDNN's attention backend off for the whole process (scaled_dot_product_attention then picks
    flash attention, or memory-efficient attention when there is a mask). A no-op without CUDA."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


@dataclass(frozen=True)
class SMLimitedStream:
    """A CUDA stream whose kernels run on ``sm_count`` of the device's SMs only: a stream of a CUDA green
    context. ``context`` is held because destroying the green context invalidates its streams. Work on the
    stream shares memory with the rest of the process; the other SMs stay free for other streams' kernels."""

    context: object
    stream: torch.cuda.Stream
    sm_count: int


def sm_limited_stream(sm_count: int, device: torch.device) -> SMLimitedStream:
    """A stream on ``sm_count`` SMs of ``device`` (a positive multiple of :data:`GREEN_CONTEXT_SM_GRANULE`,
    fewer than the device has). Raises ``ValueError`` naming the limit when the count or the build does not
    allow it."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not green_contexts.SUPPORTED:
        raise ValueError("this PyTorch build has no CUDA green contexts (needs CUDA 12.8+)")
    if sm_count <= 0 or sm_count % GREEN_CONTEXT_SM_GRANULE or sm_count >= total:
        raise ValueError(f"{sm_count} SMs: use a multiple of {GREEN_CONTEXT_SM_GRANULE} below the device's {total}")
    context = green_contexts.GreenContext.create(sm_count, device.index if device.index is not None else 0)
    return SMLimitedStream(context, context.Stream(), sm_count)
