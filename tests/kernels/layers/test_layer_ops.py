"""Tests of ``kernels.layers.layer_ops`` (the fused element-wise ops of the engine's decoder layers: rms_norm,
qk_norm_rope, silu_mul): the Triton kernels (CUDA when there is a GPU, else the Triton interpreter on the CPU)
against the references, on strided views of fused projections too, their shape checks, and the references against
Hugging Face's own Qwen3 modules."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from skyrl_clora.kernels import qk_norm_rope, rms_norm, silu_mul

from tests.support.helpers import assert_fused_close
from tests.support.layer_checks import DEVICE
from tests.support.markers import triton_runs

pytestmark = triton_runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference_and_hf(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    # three programs of 32 rows, the last partial; x a column view (a folded LoRA layer's output), residual a
    # column view of another width
    x = torch.randn(70, 128, generator=gen).to(DEVICE, dtype)[:, :96]
    residual = torch.randn(70, 112, generator=gen).to(DEVICE, dtype)[:, 8:104] if with_residual else None
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE, dtype)
    want_y, want_h = rms_norm(x, weight, 1e-6, residual, backend="torch")
    got_y, got_h = rms_norm(x, weight, 1e-6, residual, backend="triton")
    assert_fused_close(got_y, want_y, dtype)
    assert_fused_close(got_h, want_h, dtype)  # the CPU interpreter rounds to bf16 toward zero, CUDA to nearest
    module = Qwen3RMSNorm(96, eps=1e-6).to(DEVICE, dtype)
    module.weight.data.copy_(weight)
    assert torch.equal(want_y, module(want_h)), "the reference must be Hugging Face's RMSNorm op for op"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_matches_reference_and_hf(dtype: torch.dtype, with_norm: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    tokens, heads_q, heads_k, dim = 45, 4, 2, 32  # q: 180 (token, head) rows, two programs of 128; k: one
    q = torch.randn(tokens, heads_q, dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(tokens, heads_k, dim, generator=gen).to(DEVICE, dtype)
    config = Qwen3Config(hidden_size=heads_q * dim, num_attention_heads=heads_q, num_key_value_heads=heads_k, head_dim=dim)
    positions = torch.randint(0, 200, (1, tokens), generator=gen).to(DEVICE)
    cos, sin = Qwen3RotaryEmbedding(config).to(DEVICE)(q.view(1, tokens, -1), positions)
    cos, sin = cos[0].to(dtype), sin[0].to(dtype)
    weights = [(1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, dtype) for _ in range(2)] if with_norm else [None, None]
    want_q, want_k = qk_norm_rope(q, k, cos, sin, *weights, 1e-6, backend="torch")
    got_q, got_k = qk_norm_rope(q, k, cos, sin, *weights, 1e-6, backend="triton")
    assert_fused_close(got_q, want_q, dtype)
    assert_fused_close(got_k, want_k, dtype)
    assert not torch.allclose(want_q.float(), q.float()), "the rotation must change q"
    # Hugging Face's path: norm per head, transpose to [1, H, N, d], apply_rotary_pos_emb.
    norm_q, norm_k = Qwen3RMSNorm(dim, eps=1e-6).to(DEVICE, dtype), Qwen3RMSNorm(dim, eps=1e-6).to(DEVICE, dtype)
    if with_norm:
        norm_q.weight.data.copy_(weights[0])
        norm_k.weight.data.copy_(weights[1])
    hf_q, hf_k = (norm_q(q), norm_k(k)) if with_norm else (q, k)
    hf_q, hf_k = apply_rotary_pos_emb(hf_q.transpose(0, 1)[None], hf_k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(want_q, hf_q[0].transpose(0, 1)) and torch.equal(want_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    gate = (3 * torch.randn(7, 300, generator=gen)).to(DEVICE, dtype)
    up = torch.randn(7, 300, generator=gen).to(DEVICE, dtype)
    assert_fused_close(silu_mul(gate, up, backend="triton"), silu_mul(gate, up, backend="torch"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projection_slices_are_read_in_place(dtype: torch.dtype) -> None:
    """q/k as column slices of one fused q/k/v output and gate/up as halves of one gate/up output (token rows
    wider than the slice): the kernels read them in place and match the reference on contiguous copies."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads_q, heads_k, dim = 5, 4, 2, 32
    qkv = torch.randn(tokens, (heads_q + 2 * heads_k) * dim, generator=gen).to(DEVICE, dtype)
    q, k, _ = qkv.split([heads_q * dim, heads_k * dim, heads_k * dim], dim=-1)
    q, k = q.view(tokens, heads_q, dim), k.view(tokens, heads_k, dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = torch.randn(tokens, dim, generator=gen).to(DEVICE, dtype), torch.randn(tokens, dim, generator=gen).to(DEVICE, dtype)
    weights = [(1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, dtype) for _ in range(2)]
    want_q, want_k = qk_norm_rope(q.contiguous(), k.contiguous(), cos, sin, *weights, 1e-6, backend="torch")
    got_q, got_k = qk_norm_rope(q, k, cos, sin, *weights, 1e-6, backend="triton")
    assert_fused_close(got_q, want_q, dtype)
    assert_fused_close(got_k, want_k, dtype)
    gate_up = (3 * torch.randn(2, 3, 2 * 1100, generator=gen)).to(DEVICE, dtype)  # [B, L, 2I], I past one block
    gate, up = gate_up.chunk(2, dim=-1)
    got = silu_mul(gate, up, backend="triton")
    assert got.shape == gate.shape and got.is_contiguous()
    assert_fused_close(got, silu_mul(gate.contiguous(), up.contiguous(), backend="torch"), dtype)


def test_bad_shapes_are_rejected() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="unit column stride"):
        rms_norm(x, torch.ones(16, device=DEVICE), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="unit column stride"):
        rms_norm(x[:, ::2], torch.ones(4, device=DEVICE), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="power-of-two head dim"):
        qk_norm_rope(torch.zeros(2, 2, 24, device=DEVICE), torch.zeros(2, 1, 24, device=DEVICE),
                     torch.zeros(2, 24, device=DEVICE), torch.zeros(2, 24, device=DEVICE), None, None, 1e-6,
                     backend="triton")
    with pytest.raises(ValueError, match="one shape and dtype"):
        silu_mul(x, torch.zeros(2, 9, device=DEVICE), backend="triton")
