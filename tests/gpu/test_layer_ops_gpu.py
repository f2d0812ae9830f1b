"""GPU parity of the row-tiled layer ops at training sizes (Qwen3-1.7B's micro-batch of ~20k tokens): RMSNorm
over hidden rows and per-head rows, forward and backward, and the q/k norm + rotary kernel, against the torch
references. Skipped without CUDA. Tolerance: ``tests.support.helpers.FUSED_OP_TOLERANCE``."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import qk_norm_rope, rms_norm, rms_norm_with_grad, rope_with_grad

from tests.support.helpers import assert_fused_close

pytestmark = pytest.mark.gpu
TOKENS = 20_001  # not a multiple of any row tile


def _tables(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(TOKENS, 64, generator=gen) * 300
    angles = torch.cat([angles, angles], dim=-1)  # both halves equal, as rotary tables are built
    return angles.cos().cuda().bfloat16(), angles.sin().cuda().bfloat16()


@pytest.mark.parametrize("shape", [(TOKENS, 2048), (TOKENS, 16, 128), (TOKENS, 6144)])
def test_rms_norm_forward_and_backward_at_training_sizes(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).cuda().bfloat16()
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).cuda().bfloat16()
    dy = torch.randn(shape, generator=gen).cuda().bfloat16()
    results = []
    for backend in ("torch", "triton"):
        leaf = x.clone().requires_grad_(True)
        y = rms_norm_with_grad(leaf, weight, 1e-6, backend=backend)
        y.backward(dy)
        results.append((y.detach(), leaf.grad))
    (want_y, want_dx), (got_y, got_dx) = results
    assert_fused_close(got_y, want_y, torch.bfloat16)
    assert_fused_close(got_dx, want_dx, torch.bfloat16)
    rows = x.reshape(-1, shape[-1])
    residual = torch.randn(rows.shape, generator=gen).cuda().bfloat16()
    want = rms_norm(rows, weight, 1e-6, residual, backend="torch")
    got = rms_norm(rows, weight, 1e-6, residual, backend="triton")
    assert_fused_close(got[0], want[0], torch.bfloat16)
    assert_fused_close(got[1], want[1], torch.bfloat16)


@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_at_training_sizes(with_norm: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(TOKENS, 16, 128, generator=gen).cuda().bfloat16()
    k = torch.randn(TOKENS, 8, 128, generator=gen).cuda().bfloat16()
    cos, sin = _tables(gen)
    weights = [(1 + 0.1 * torch.randn(128, generator=gen)).cuda().bfloat16() for _ in range(2)] if with_norm else [None, None]
    want = qk_norm_rope(q, k, cos, sin, *weights, 1e-6, backend="torch")
    got = qk_norm_rope(q, k, cos, sin, *weights, 1e-6, backend="triton")
    for g, w in zip(got, want):
        assert_fused_close(g, w, torch.bfloat16)


def test_rope_with_grad_at_training_sizes() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(TOKENS, 16, 128, generator=gen).cuda().bfloat16()
    k = torch.randn(TOKENS, 8, 128, generator=gen).cuda().bfloat16()
    dq, dk = torch.randn(q.shape, generator=gen).cuda().bfloat16(), torch.randn(k.shape, generator=gen).cuda().bfloat16()
    cos, sin = _tables(gen)
    results = []
    for backend in ("torch", "triton"):
        leaves = [q.clone().requires_grad_(True), k.clone().requires_grad_(True)]
        out_q, out_k = rope_with_grad(*leaves, cos, sin, backend=backend)
        torch.autograd.backward([out_q, out_k], [dq, dk])
        results.append((out_q.detach(), out_k.detach(), leaves[0].grad, leaves[1].grad))
    for got, want in zip(results[1], results[0]):
        assert_fused_close(got, want, torch.bfloat16)
