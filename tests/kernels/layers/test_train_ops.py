"""Tests of ``kernels.layers.train_ops`` (the trainer's differentiable fused ops: ``RMSNormFrozenWeight``,
``SiluMul``, ``RotaryEmbedding``, through ``rms_norm_with_grad``, ``silu_mul_with_grad`` and ``rope_with_grad``):
Triton forward and backward (CUDA when there is a GPU, else the Triton interpreter on the CPU) against the
references differentiated by autograd; and, through the trainer's fused modules (``trainer.fused_modules``) that
run them, Hugging Face's own Qwen3 forward and backward and rotary embedding reproduced."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.kernels import dispatch, rms_norm_with_grad, rope_with_grad, silu_mul_with_grad
from skyrl_clora.lora.layers import LoRARouting, attach_multi_lora, write_slot
from skyrl_clora.trainer.fused_modules import FusedRMSNorm, FusedSwiGLUMLP, fuse_elementwise_modules, fused_apply_rotary_pos_emb

from tests.support.helpers import assert_fused_close, random_adapter
from tests.support.layer_checks import DEVICE
from tests.support.layer_checks import forward_backward as _forward_backward
from tests.support.markers import triton_runs

pytestmark = triton_runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 96), (2, 30, 4, 48)])  # rows of a hidden state; per-head q/k norm rows (4 programs)
def test_rms_norm_with_grad_matches_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE, dtype)
    dy = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    want_y, (want_dx,) = _forward_backward(lambda t: rms_norm_with_grad(t, weight, 1e-6, backend="torch"), [x], dy)
    got_y, (got_dx,) = _forward_backward(lambda t: rms_norm_with_grad(t, weight, 1e-6, backend="triton"), [x], dy)
    assert got_y.shape == want_y.shape and got_dx.shape == x.shape
    assert_fused_close(got_y, want_y, dtype)
    assert_fused_close(got_dx, want_dx, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_with_grad_matches_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    gate, up, dy = (3 * torch.randn(5, 300, generator=gen)).to(DEVICE, dtype), torch.randn(5, 300, generator=gen).to(
        DEVICE, dtype), torch.randn(5, 300, generator=gen).to(DEVICE, dtype)  # 1500: not a multiple of the block
    want_y, want_grads = _forward_backward(lambda g, u: silu_mul_with_grad(g, u, backend="torch"), [gate, up], dy)
    got_y, got_grads = _forward_backward(lambda g, u: silu_mul_with_grad(g, u, backend="triton"), [gate, up], dy)
    assert_fused_close(got_y, want_y, dtype)
    for got, want in zip(got_grads, want_grads):
        assert_fused_close(got, want, dtype)


def _rotary_tables(rows: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [rows, dim]`` as rotary tables are built: both halves of the last dim equal."""
    angles = 50 * torch.rand(rows, dim // 2, generator=gen)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_grad_matches_the_reference(dtype: torch.dtype) -> None:
    """q and k with different head counts, q a strided view (a column slice of a wider projection)."""
    gen = torch.Generator().manual_seed(4)
    rows, dim = 9, 32
    cos, sin = (t.to(DEVICE, dtype) for t in _rotary_tables(rows, dim, gen))
    q = (2 * torch.randn(rows, 6, dim, generator=gen)).to(DEVICE, dtype)
    k = (2 * torch.randn(rows, 2, dim, generator=gen)).to(DEVICE, dtype)
    dq, dk = (torch.randn(x.shape, generator=gen).to(DEVICE, dtype) for x in (q, k))

    def run(backend: str) -> list[torch.Tensor]:
        wide = torch.cat([q, torch.zeros_like(q)], dim=1).detach().requires_grad_(True)  # q: heads 0..5 of 12
        k_leaf = k.detach().clone().requires_grad_(True)
        q_out, k_out = rope_with_grad(wide[:, :6], k_leaf, cos, sin, backend=backend)
        torch.autograd.backward([q_out, k_out], [dq, dk])
        return [q_out.detach(), k_out.detach(), wide.grad[:, :6], k_leaf.grad]

    want, got = run("torch"), run("triton")
    assert not torch.allclose(want[0], q), "the rotation must change q"
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert_fused_close(g, w, dtype)


def test_fused_rotary_is_hf_apply_rotary_pos_emb_in_its_layout() -> None:
    """In the attention's layout (q, k: transposed views of [B, L, H, d]; cos, sin: [1, L, d] broadcast over
    the batch) the fused rotary gives Hugging Face's values and gradients; on the CPU bit for bit."""
    from transformers.models.qwen3 import modeling_qwen3

    original = getattr(modeling_qwen3.apply_rotary_pos_emb, "fused_from", modeling_qwen3.apply_rotary_pos_emb)
    gen = torch.Generator().manual_seed(5)
    batch, length, dim = 3, 7, 16
    cos, sin = (t[None].to(DEVICE) for t in _rotary_tables(length, dim, gen))
    q = torch.randn(batch, length, 4, dim, generator=gen).to(DEVICE)
    k = torch.randn(batch, length, 2, dim, generator=gen).to(DEVICE)
    grads = [torch.randn(batch, h, length, dim, generator=gen).to(DEVICE) for h in (4, 2)]
    results = []
    for rotary in (original, lambda *args: fused_apply_rotary_pos_emb(original, *args)):
        q_leaf, k_leaf = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        outs = rotary(q_leaf.transpose(1, 2), k_leaf.transpose(1, 2), cos, sin)
        torch.autograd.backward(list(outs), grads)
        results.append([outs[0].detach(), outs[1].detach(), q_leaf.grad, k_leaf.grad])
    for got, want in zip(results[1], results[0]):
        assert got.shape == want.shape
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _model_with_adapter() -> tuple[Qwen3ForCausalLM, LoRARouting]:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM(config).to(DEVICE)
    routing, layers = attach_multi_lora(model, num_slots=1, max_rank=8, trainable=True)
    write_slot(layers, 0, random_adapter(layers, 3, rank=8))
    return model, routing


def _loss_and_lora_grads(model: Qwen3ForCausalLM, routing: LoRARouting,
                         input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with routing.route(torch.zeros(input_ids.numel(), dtype=torch.long, device=DEVICE)):  # every row: slot 0
        logits = model(input_ids=input_ids, use_cache=False).logits
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_fused_modules_reproduce_the_hf_forward_and_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    input_ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    plain, plain_routing = _model_with_adapter()
    want_loss, want_grads = _loss_and_lora_grads(plain, plain_routing, input_ids)
    assert want_grads and all(float(g.abs().max()) > 0 for g in want_grads), "every adapter tensor gets a gradient"
    fused, routing = _model_with_adapter()
    # per layer 4 norms and 1 MLP, the final norm, and the attention class's rotary embedding
    assert fuse_elementwise_modules(fused) == 2 * 4 + 2 + 1 + 1
    assert isinstance(fused.model.norm, FusedRMSNorm) and isinstance(fused.model.layers[1].mlp, FusedSwiGLUMLP)
    assert {n for n, _ in fused.named_parameters()} == {n for n, _ in plain.named_parameters()}, "paths kept"
    got_loss, got_grads = _loss_and_lora_grads(fused, routing, input_ids)
    if DEVICE == "cpu":  # the torch path is Hugging Face's ops in order: bit-identical
        assert torch.equal(got_loss, want_loss) and all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
        monkeypatch.setattr(dispatch, "use_triton", lambda x, backend: True)  # now the Triton kernels
        fused.zero_grad()
        got_loss, got_grads = _loss_and_lora_grads(fused, routing, input_ids)
    assert torch.allclose(got_loss, want_loss, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), float((got - want).abs().max())
