"""Process-wide CUDA settings the trainer and the memory plan rely on, set once by whoever builds a process's
engine and trainer (``backends.embedded.services.build_services``, the SkyRL worker, the benchmarks), never by a
component's constructor.

PyTorch's scaled_dot_product_attention prefers cuDNN's attention on Hopper, and cuDNN builds an execution
graph for every new combination of shapes (tens to hundreds of milliseconds, then cached per shape). The
trainer's micro-batches change their batch and sequence lengths all the time (so did the engine's prefill
passes when they called SDPA: a prefill round then cost about the same whatever it computed, RESULTS.md, Engine
and trainer settings and why). Flash and memory-efficient attention have no per-shape set-up.
"""

from __future__ import annotations

import os

import torch


def avoid_cudnn_attention() -> None:
    """Turns cuDNN's attention backend off for the whole process (scaled_dot_product_attention then picks
    flash attention, or memory-efficient attention when there is a mask). A no-op without CUDA."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


def use_expandable_segments() -> None:
    """Makes the CUDA caching allocator grow and shrink its segments in place (``expandable_segments:True``), unless
    ``PYTORCH_CUDA_ALLOC_CONF`` chooses otherwise. Training passes and the engine's passes of changing shapes
    otherwise leave the cached memory cut into pieces: a concurrent long-tailed run at the memory plan's budget
    ran out of memory with much of it cached but free (RESULTS.md, Real rollouts). A no-op without CUDA."""
    if torch.cuda.is_available() and "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
