"""Swaps a Hugging Face decoder's RMSNorm and SwiGLU MLP modules for fused equivalents, in place, and its
attention's rotary embedding for a fused one.

The trainer runs the decoder's own forward (attention, rotary embedding, residuals) under autograd; its
RMSNorms (four per layer in Qwen3, each over a whole micro-batch of activations), its MLP activation
``act_fn(gate_proj(x)) * up_proj(x)`` and the rotary embedding of q and k are element-wise chains that move
every activation through memory several times forward and backward. :func:`fuse_elementwise_modules`
replaces them with modules and a function that call ``kernels.rms_norm_with_grad``,
``kernels.silu_mul_with_grad`` and ``kernels.rope_with_grad`` (one Triton launch each way on a GPU; Hugging
Face's exact op sequence elsewhere, so CPU results do not change). The new modules hold the same weight
tensors and projection modules (LoRA-wrapped or not), so parameter paths and the LoRA layers' registry stay
valid.

The rotary embedding is a function of the attention class's module (``apply_rotary_pos_emb``, looked up at
each call), not a module: it is replaced in that Python module, so every model of the class in the process
uses :func:`fused_apply_rotary_pos_emb` from then on (the same values up to rounding: one fp32 rounding
instead of three in the model dtype).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from skyrl_clora.kernels import rms_norm_with_grad, rope_with_grad, silu_mul_with_grad


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


def fused_apply_rotary_pos_emb(original: Callable, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` through ``kernels.rope_with_grad`` for its
    attention layout: ``q: [B, Hq, L, d]``, ``k: [B, Hk, L, d]`` (transposed views of ``[B, L, H, d]``, as the
    attention forward makes them), ``cos, sin: [B or 1, L, d]``; returns the same layout. Other layouts go
    to ``original``."""
    if unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3:
        return original(q, k, cos, sin, unsqueeze_dim)
    batch, _, length, dim = q.shape
    q_rows = q.transpose(1, 2).reshape(batch * length, q.shape[1], dim)  # a view for the attention's layout
    k_rows = k.transpose(1, 2).reshape(batch * length, k.shape[1], dim)
    cos_rows = cos.expand(batch, length, dim).reshape(batch * length, dim)
    sin_rows = sin.expand(batch, length, dim).reshape(batch * length, dim)
    q_out, k_out = rope_with_grad(q_rows, k_rows, cos_rows, sin_rows)
    return (q_out.view(batch, length, -1, dim).transpose(1, 2), k_out.view(batch, length, -1, dim).transpose(1, 2))


def _fuse_rotary(attention: nn.Module) -> bool:
    """Replaces ``apply_rotary_pos_emb`` in the Python module of ``attention``'s class by the fused form
    (once); returns whether that module has one."""
    module = sys.modules[type(attention).__module__]
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None:
        return False
    if getattr(current, "fused_from", None) is None:
        def fused(q, k, cos, sin, unsqueeze_dim=1, _original=current):
            return fused_apply_rotary_pos_emb(_original, q, k, cos, sin, unsqueeze_dim)

        fused.fused_from = current
        module.apply_rotary_pos_emb = fused
    return True


def _is_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _is_swiglu_mlp(module: nn.Module, hidden_act: str) -> bool:
    return hidden_act == "silu" and all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def fuse_elementwise_modules(model: nn.Module) -> int:
    """Replaces every RMSNorm module (a class named ``*RMSNorm`` with ``weight`` and ``variance_epsilon``) and
    every SwiGLU MLP (``gate_proj``/``up_proj``/``down_proj``/``act_fn`` in a model with ``hidden_act=silu``)
    of ``model`` by :class:`FusedRMSNorm` / :class:`FusedSwiGLUMLP` sharing its tensors and submodules, and
    the rotary embedding of its attention modules' class (``apply_rotary_pos_emb`` of their Python module) by
    :func:`fused_apply_rotary_pos_emb`. The norm weights must be frozen. Returns how many modules and rotary
    functions were replaced."""
    hidden_act = getattr(getattr(model, "config", None), "hidden_act", "")
    targets = []
    rotary = set()
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and _fuse_rotary(module):
            rotary.add(type(module))
        elif _is_rms_norm(module):
            targets.append((name, FusedRMSNorm(module.weight, module.variance_epsilon)))
        elif _is_swiglu_mlp(module, hidden_act):
            targets.append((name, FusedSwiGLUMLP(module.gate_proj, module.up_proj, module.down_proj)))
    for name, replacement in targets:
        parent_path, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attribute, replacement)
    return len(targets) + len(rotary)
