"""Host lists to device tensors without stalling the host.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and CUDA synchronises the stream
before such a copy: the host waits for every kernel already queued, so it can no longer run ahead of the
GPU (in an eager forward of a few thousand kernel launches, the device then idles while the host
launches). :func:`lists_to_device` stages all lists in one pinned buffer and copies it asynchronously.
The buffer is built by numpy (cheaper per element than ``torch.tensor`` of a Python list; numpy arrays are taken
as they are).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_HOST_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64}


def lists_to_device(values: Sequence[Sequence[int] | Sequence[float] | np.ndarray], device: torch.device,
                    dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
    """``[torch.tensor(v, dtype=dtype, device=device) for v in values]`` (lists or 1-D numpy arrays) from one
    host buffer and one copy, asynchronous on a GPU (the buffer is pinned; the caching host allocator keeps
    it until the copy ran)."""
    host_dtype = _HOST_DTYPES[dtype]
    flat = torch.from_numpy(np.concatenate([np.asarray(v, dtype=host_dtype) for v in values]))
    if device.type == "cuda":
        flat = flat.pin_memory()
    return list(flat.to(device, non_blocking=True).split([len(v) for v in values]))
