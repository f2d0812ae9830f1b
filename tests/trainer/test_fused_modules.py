"""Fused element-wise modules (:mod:`skyrl_clora.trainer.fused_modules`) on the CPU, where the kernels take Hugging
Face's op sequence: fusing a Qwen3 model replaces every RMSNorm, every SwiGLU MLP (silu models only) and its
attention class's rotary embedding (once, however often it is fused), shares the original tensors and submodules,
and leaves the logits bit for bit; the fused rotary embedding is Hugging Face's for the attention layout and hands
other layouts to the original."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers.models.qwen3.modeling_qwen3 as qwen3
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.trainer.fused_modules import (FusedRMSNorm, FusedSwiGLUMLP, fuse_elementwise_modules,
                                               fused_apply_rotary_pos_emb)


@pytest.fixture
def unfused_rotary(monkeypatch: pytest.MonkeyPatch) -> Callable:
    """Qwen3's own ``apply_rotary_pos_emb`` in its module for the test, whatever an earlier fusing left there (the
    fusing is process-wide; it is put back afterwards)."""
    original = getattr(qwen3.apply_rotary_pos_emb, "fused_from", qwen3.apply_rotary_pos_emb)
    monkeypatch.setattr(qwen3, "apply_rotary_pos_emb", original)
    return original


def _model(hidden_act: str = "silu") -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, hidden_act=hidden_act)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval().requires_grad_(False)


def test_fusing_replaces_norms_mlps_and_the_rotary_embedding_and_keeps_the_logits(unfused_rotary: Callable) -> None:
    model = _model()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    norm_weight, gate = model.model.layers[0].input_layernorm.weight, model.model.layers[1].mlp.gate_proj
    # per layer 4 norms (input, post-attention, q, k) and the MLP; the final norm; the attention class's rotary
    assert fuse_elementwise_modules(model) == 2 * 5 + 1 + 1
    layer = model.model.layers[0]
    assert all(isinstance(module, FusedRMSNorm) for module in (layer.input_layernorm, layer.post_attention_layernorm,
                                                               layer.self_attn.q_norm, layer.self_attn.k_norm,
                                                               model.model.norm))
    assert isinstance(model.model.layers[1].mlp, FusedSwiGLUMLP) and model.model.layers[1].mlp.gate_proj is gate
    assert layer.input_layernorm.weight is norm_weight, "the fused module holds the original tensor"
    assert qwen3.apply_rotary_pos_emb.fused_from is unfused_rotary
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    fuse_elementwise_modules(_model())
    assert qwen3.apply_rotary_pos_emb.fused_from is unfused_rotary, "fused once, not wrapped again"


def test_a_model_without_silu_keeps_its_mlp(unfused_rotary: Callable) -> None:
    model = _model(hidden_act="gelu")
    assert fuse_elementwise_modules(model) == 2 * 4 + 1 + 1
    assert isinstance(model.model.layers[0].mlp, qwen3.Qwen3MLP)


def test_the_fused_rotary_embedding_is_hugging_faces_and_hands_on_other_layouts(unfused_rotary: Callable) -> None:
    generator = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 5, 8, generator=generator), torch.randn(2, 2, 5, 8, generator=generator)
    angles = torch.randn(1, 5, 4, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = fused_apply_rotary_pos_emb(unfused_rotary, q, k, cos, sin)
    want = unfused_rotary(q, k, cos, sin)
    assert got[0].shape == q.shape and got[1].shape == k.shape
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    calls = []
    handed = fused_apply_rotary_pos_emb(lambda *args: calls.append(args) or ("q", "k"), q, k, cos, sin, unsqueeze_dim=2)
    assert handed == ("q", "k") and len(calls) == 1 and calls[0][-1] == 2
