"""Process-wide CUDA settings the trainer relies on.

PyTorch's scaled_dot_product_attention prefers cuDNN's attention on Hopper, and cuDNN builds an execution
graph for every new combination of shapes (tens to hundreds of milliseconds, then cached per shape). The
trainer's micro-batches change their batch and sequence lengths all the time (so did the engine's prefill
passes when they called SDPA: a prefill round cost ~120-150 ms on the H200 whatever it computed,
RESULTS.md, Engine and trainer settings and why). Flash and memory-efficient attention have no per-shape set-up.
"""

from __future__ import annotations

import torch


def avoid_cudnn_attention() -> None:
    """Turns cuDNN's attention backend off for the whole process (scaled_dot_product_attention then picks
    flash attention, or memory-efficient attention when there is a mask). A no-op without CUDA."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)
