"""Tests of ``kernels.lora.dense_lora`` (``DenseLoRALinear``, one adapter slot applied to every row with plain torch
GEMMs): values and gradients equal the routed layer's (``lora_linear`` with every row in the slot), every other
slot's gradients are zero, and the gradients follow the formulas of the module (B's alone when only B is trainable).
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import dense_lora_linear, lora_linear
from skyrl_clora.kernels.lora.dense_lora import DenseLoRALinear
from tests.support.markers import triton_runs


def _layer_and_grads(op, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     dy: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, lora_a, lora_b)]
    y = op(*leaves)
    y.backward(dy)
    return [y.detach()] + [leaf.grad for leaf in leaves]


@triton_runs
@pytest.mark.parametrize("bias", [False, True])
def test_dense_lora_linear_equals_the_routed_layer_with_every_row_in_one_slot(bias: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    tokens, h_in, h_out, slots, max_rank = 37, 48, 40, 3, 16
    x = torch.randn(tokens, h_in, generator=gen, dtype=torch.float64)
    weight = torch.randn(h_out, h_in, generator=gen, dtype=torch.float64) / 7
    base_bias = torch.randn(h_out, generator=gen, dtype=torch.float64) if bias else None
    lora_a = torch.randn(slots, max_rank, h_in, generator=gen, dtype=torch.float64)
    lora_a[1, 8:] = 0  # slot 1 has rank 8 of the 16
    lora_b = torch.randn(slots, h_out, max_rank, generator=gen, dtype=torch.float64)
    lora_b[1, :, 8:] = 0
    scales = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
    dy = torch.randn(tokens, h_out, generator=gen, dtype=torch.float64)
    outputs = []
    for slot in (1, 2):
        routed = _layer_and_grads(lambda t, a, b: lora_linear(t, weight, base_bias, a, b, scales,
                                                              torch.full((tokens,), slot), backend="torch"),
                                  x, lora_a, lora_b, dy)
        dense = _layer_and_grads(lambda t, a, b: dense_lora_linear(t, weight, base_bias, a, b, scales, slot),
                                 x, lora_a, lora_b, dy)
        for got, want in zip(dense, routed):
            torch.testing.assert_close(got, want)
        other = [s for s in range(slots) if s != slot]
        assert dense[2][other].abs().sum() == 0 and dense[3][other].abs().sum() == 0
        assert dense[2][slot].abs().sum() > 0 and dense[3][slot].abs().sum() > 0
        outputs.append(dense[0])
    assert not torch.allclose(outputs[0], outputs[1]), "the two slots' adapters must give different outputs"
    with pytest.raises(ValueError, match="outside the adapters' 3 slots"):
        dense_lora_linear(x, weight, base_bias, lora_a, lora_b, scales, 3)


def test_gradients_follow_the_formulas_of_the_module() -> None:
    """With x frozen, ``dA[slot] = scale * (dy @ B).T @ x`` and ``dB[slot] = dy.T @ (scale * x @ A.T)``, zero for
    the other slots; with B alone trainable, B's gradient alone, by the same formula."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    scales = torch.tensor([0.5, 3.0], dtype=torch.float64)
    dy = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    a0 = torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    b0 = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    lora_a, lora_b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    y = DenseLoRALinear.apply(x, weight, None, lora_a, lora_b, scales, 1)
    torch.testing.assert_close(y, x @ weight.T + 3.0 * (x @ a0[1].T) @ b0[1].T)
    y.backward(dy)
    torch.testing.assert_close(lora_a.grad[1], 3.0 * (dy @ b0[1]).T @ x)
    torch.testing.assert_close(lora_b.grad[1], dy.T @ (3.0 * x @ a0[1].T))
    assert not lora_a.grad[0].any() and not lora_b.grad[0].any()
    only_b = b0.clone().requires_grad_(True)
    DenseLoRALinear.apply(x, weight, None, a0, only_b, scales, 0).backward(dy)
    torch.testing.assert_close(only_b.grad[0], dy.T @ (0.5 * x @ a0[0].T))
    assert not only_b.grad[1].any()
