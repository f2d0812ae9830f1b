"""Swaps a Hugging Face decoder's RMSNorm and SwiGLU MLP modules for fused equivalents, in place.

The trainer runs the decoder's own forward (attention, rotary embedding, residuals) under autograd; its
RMSNorms (four per layer in Qwen3, each over a whole micro-batch of activations) and its MLP activation
``act_fn(gate_proj(x)) * up_proj(x)`` are element-wise chains that move every activation through memory
several times forward and backward. :func:`fuse_elementwise_modules` replaces them with modules that call
``kernels.rms_norm_with_grad`` and ``kernels.silu_mul_with_grad`` (one Triton launch each way on a GPU;
Hugging Face's exact op sequence elsewhere, so CPU results do not change). The new modules hold the same
weight tensors and projection modules (LoRA-wrapped or not), so parameter paths and the LoRA layers'
registry stay valid.
"""

from __future__ import annotations

import torch
from torch import nn

from skyrl_clora.kernels import rms_norm_with_grad, silu_mul_with_grad


class FusedRMSNorm(nn.Module):
    """RMSNorm over the last dim with a frozen ``weight: [H]`` (Hugging Face's ``*RMSNorm`` semantics)."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_with_grad(hidden_states, self.weight, self.variance_epsilon)


class FusedSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` over the given projection modules."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul_with_grad(self.gate_proj(x), self.up_proj(x)))


def _is_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _is_swiglu_mlp(module: nn.Module, hidden_act: str) -> bool:
    return hidden_act == "silu" and all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def fuse_elementwise_modules(model: nn.Module) -> int:
    """Replaces every RMSNorm module (a class named ``*RMSNorm`` with ``weight`` and ``variance_epsilon``) and
    every SwiGLU MLP (``gate_proj``/``up_proj``/``down_proj``/``act_fn`` in a model with ``hidden_act=silu``)
    of ``model`` by :class:`FusedRMSNorm` / :class:`FusedSwiGLUMLP` sharing its tensors and submodules.
    The norm weights must be frozen. Returns how many modules were replaced."""
    hidden_act = getattr(getattr(model, "config", None), "hidden_act", "")
    targets = []
    for name, module in model.named_modules():
        if _is_rms_norm(module):
            targets.append((name, FusedRMSNorm(module.weight, module.variance_epsilon)))
        elif _is_swiglu_mlp(module, hidden_act):
            targets.append((name, FusedSwiGLUMLP(module.gate_proj, module.up_proj, module.down_proj)))
    for name, replacement in targets:
        parent_path, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attribute, replacement)
    return len(targets)
