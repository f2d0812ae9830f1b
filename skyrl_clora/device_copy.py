"""Host lists to device tensors without stalling the host.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and CUDA synchronises the stream
before such a copy: the host waits for every kernel already queued, so it can no longer run ahead of the
GPU (in an eager forward of a few thousand kernel launches, the device then idles while the host
launches). :func:`lists_to_device` stages all lists in one pinned buffer and copies it asynchronously.
"""

from __future__ import annotations

import itertools

import torch


def lists_to_device(values: list[list[int]] | list[list[float]], device: torch.device,
                    dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
    """``[torch.tensor(v, dtype=dtype, device=device) for v in values]`` from one host buffer and one copy,
    asynchronous on a GPU (the buffer is pinned; the caching host allocator keeps it until the copy ran)."""
    flat = torch.tensor(list(itertools.chain.from_iterable(values)), dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory()
    return list(flat.to(device, non_blocking=True).split([len(v) for v in values]))
