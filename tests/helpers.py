"""Helpers shared by the tests (imported as ``helpers``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear
from skyrl_clora.lora.peft_export import init_adapter


def random_adapter(layers: dict[str, MultiLoRALinear], seed: int, rank: int = 8, alpha: float = 16.0,
                   b_std: float = 0.3) -> AdapterWeights:
    """PEFT-initialised A with a random (non-zero) B, so the adapter visibly changes the model's output."""
    generator = torch.Generator().manual_seed(seed)
    adapter = init_adapter(layers, rank, alpha, generator)
    for path in adapter.b:
        adapter.b[path] = torch.randn(adapter.b[path].shape, generator=generator) * b_std
    return adapter
