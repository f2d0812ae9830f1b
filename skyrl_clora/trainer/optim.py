"""AdamW on one device slot's fp32 masters with ``torch._foreach_*`` ops over all of the slot's tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_clora.trainer.adapter_store import AdapterStore


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings shared by all tenants (the learning rate is per tenant, in its schedule)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


@torch.no_grad()
def adamw_slot(store: AdapterStore, slot_index: int, lr: float, step: int, config: OptimizerConfig) -> torch.Tensor:
    """Clips the slot's gradients to ``config.max_grad_norm`` (global norm over all its tensors) and applies
    one AdamW step (``step`` >= 1, for the bias corrections) to its fp32 masters, then writes the masters
    into the slot's LoRA parameters. Returns the pre-clip gradient norm as a 0-dim device tensor (no host
    synchronisation). Per tensor::

        g = grad.float() * min(1, max_grad_norm / (norm + 1e-6))
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        master *= 1 - lr * weight_decay
        master -= lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
    """
    # fp32 copies of the gradients in the slot's grads staging buffer (idle while the slot is swapped in)
    grads = store.staging_views(slot_index, "grads", store.max_rank)
    torch._foreach_copy_(grads, store.param_views(slot_index, grads=True))
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    clip = (config.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, clip)
    beta1, beta2 = config.betas
    m = store.table_views(slot_index, "exp_avg")
    v = store.table_views(slot_index, "exp_avg_sq")
    master = store.table_views(slot_index, "master")
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, grads, alpha=1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    denom = torch._foreach_div(v, 1 - beta2**step)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, config.eps)
    if config.weight_decay:
        torch._foreach_mul_(master, 1 - lr * config.weight_decay)
    torch._foreach_addcdiv_(master, torch._foreach_div(m, 1 - beta1**step), denom, value=-lr)
    torch._foreach_copy_(store.param_views(slot_index), master)
    return norm
