"""AdamW on a device slot (:mod:`skyrl_clora.trainer.optim`): one ``adamw_slot`` step is ``torch.optim.AdamW``'s on the
slot's fp32 masters after clipping the gradients' global norm to ``max_grad_norm`` (as
``torch.nn.utils.clip_grad_norm_``), with decoupled weight decay; it returns the pre-clip norm and writes the
masters into the slot's LoRA parameters, leaving the other slot alone."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig, adamw_slot
from tests.support.helpers import random_adapter
from tests.support.tiny_lora_layers import two_projection_layers


def _slot_store() -> AdapterStore:
    """Tenant ``t`` (rank 4, the slots' max) swapped into slot 0 of two."""
    layers = two_projection_layers(slots=2, max_rank=4)
    store = AdapterStore(layers, num_slots=2)
    store.register("t", random_adapter(layers, seed=3, rank=4), LRSchedule(1e-2), seed=0)
    store.swap_in("t", 0)
    return store


@pytest.mark.parametrize("max_grad_norm, weight_decay", [(100.0, 0.0), (0.5, 0.1)])
def test_a_slot_step_is_torchs_adamw_after_clipping(max_grad_norm: float, weight_decay: float) -> None:
    store = _slot_store()
    config = OptimizerConfig(betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    generator = torch.Generator().manual_seed(1)
    masters = [t.clone().requires_grad_(True) for t in store.table_views(0, "master")]
    reference = torch.optim.AdamW(masters, lr=0.05, betas=config.betas, eps=config.eps, weight_decay=weight_decay)
    other = [t.clone() for t in store.param_views(1)]
    for step in (1, 2, 3):
        grads = [torch.randn(t.shape, generator=generator) for t in masters]
        with torch.no_grad():
            for view, grad in zip(store.param_views(0, grads=True), grads):
                view.copy_(grad)
        norm = adamw_slot(store, 0, lr=0.05, step=step, config=config)
        for master, grad in zip(masters, grads):
            master.grad = grad.clone()
        want_norm = torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)
        reference.step()
        assert float(norm) == pytest.approx(float(want_norm), rel=1e-6)
        for got, want in zip(store.table_views(0, "master"), masters):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-7)
        for param, master in zip(store.param_views(0), store.table_views(0, "master")):
            assert torch.equal(param, master)
    assert float(want_norm) > max_grad_norm or max_grad_norm == 100.0
    assert all(torch.equal(a, b) for a, b in zip(store.param_views(1), other)), "slot 1 untouched"
    assert any(t.abs().sum() > 0 for t in store.table_views(0, "exp_avg_sq"))
