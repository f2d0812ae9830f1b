"""Tests of ``kernels.dispatch`` (the choice between the Triton kernels and the torch references, and the checks its
entry points make on both paths): ``use_triton``'s rules, the CPU path running the references and ``backend='triton'``
on CPU tensors needing the Triton interpreter, the torch paths of ``folded_lora_linear`` (without slots: the base
layer), ``lora_linear``, ``packed_lora``, ``gather_rows`` and ``rope_with_grad``, an empty batch through the Triton
LoRA ops, and the entry points' refusals (a trainable norm weight or base layer, a slot outside the adapters,
mismatched SiLU operands, strided logits or wrong targets)."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import (
    add_lora,
    chosen_logprobs_,
    dense_lora_linear,
    folded_lora_linear,
    gather_rows,
    lora_linear,
    packed_lora,
    rms_norm_with_grad,
    rope_with_grad,
    silu_mul_with_grad,
)
from skyrl_clora.kernels.dispatch import use_triton
from skyrl_clora.kernels.layers.gather_ops import inverse_index
from skyrl_clora.kernels.reference import add_lora_ref, packed_lora_ref, qk_norm_rope_ref
from tests.support.kernel_cases import fold_problem, make_problem, reference_out
from tests.support.markers import interpreted, triton_runs


def test_cpu_dispatch_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    p = make_problem(16, 32, (24, 8), 3, 8, torch.float32, "no_adapter")
    want = p.out.clone()
    add_lora_ref(want, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots)
    add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots)
    assert torch.equal(p.out, want)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots, backend="triton")


@interpreted
def test_empty_batch_is_a_no_op() -> None:
    p = make_problem(0, 32, (16,), 3, 8, torch.bfloat16, "uniform")
    add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots, backend="triton")
    x = p.x.requires_grad_()
    y = packed_lora(x, p.lora_a, p.lora_b[0], p.scales, p.token_slots, backend="triton")
    assert y.shape == (0, 16)


@triton_runs
def test_rms_norm_with_grad_refuses_a_trainable_weight() -> None:
    weight = torch.ones(8, requires_grad=True)
    with pytest.raises(ValueError, match="frozen weight"):
        rms_norm_with_grad(torch.randn(2, 8), weight, 1e-6)


@triton_runs
def test_chosen_logprobs_refuses_strided_logits_and_wrong_targets() -> None:
    logits = torch.zeros(4, 10)
    with pytest.raises(ValueError, match="unit column stride"):
        chosen_logprobs_(logits.t(), torch.zeros(10, dtype=torch.long), write_grad=False)
    with pytest.raises(ValueError, match="int64 targets"):
        chosen_logprobs_(logits, torch.zeros(4, dtype=torch.int32), write_grad=False)


def test_use_triton_by_device_unless_a_backend_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(x, None) is False  # CPU tensors: the reference
    assert use_triton(x, "torch") is False
    assert use_triton(x, "triton") is True
    with pytest.raises(ValueError, match="backend must be None, 'triton' or 'torch', got 'cuda'"):
        use_triton(x, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton(x, "triton")
    assert use_triton(x, "torch") is False


def test_folded_lora_linear_torch_path() -> None:
    """Without slots the base layer alone (the folded weight's base rows); with slots the base layer plus
    ``add_lora_ref`` (the CPU path)."""
    p = make_problem(6, 16, (8, 4), num_slots=3, rank=4, dtype=torch.float32, layout="no_adapter")
    folded = fold_problem(p, with_bias=True)
    assert torch.equal(folded_lora_linear(p.x, folded, p.lora_b, p.scales, None), p.out)
    p.lora_a = folded.lora_a
    got = folded_lora_linear(p.x, folded, p.lora_b, p.scales, p.token_slots)
    torch.testing.assert_close(got, reference_out(p))
    assert not torch.allclose(got[p.token_slots >= 0], p.out[p.token_slots >= 0]), "the adapters must count"


def test_lora_linear_and_packed_lora_torch_paths_are_the_references() -> None:
    p = make_problem(6, 16, (8,), num_slots=3, rank=4, dtype=torch.float32, layout="no_adapter")
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    lora = packed_lora_ref(p.x, p.lora_a, p.lora_b[0], p.scales, p.token_slots)
    assert torch.equal(packed_lora(p.x, p.lora_a, p.lora_b[0], p.scales, p.token_slots), lora)
    got = lora_linear(p.x, weight, bias, p.lora_a, p.lora_b[0], p.scales, p.token_slots)
    assert torch.equal(got, torch.nn.functional.linear(p.x, weight, bias) + lora)


def test_dense_lora_linear_refuses_a_slot_outside_the_adapters_and_a_trainable_base() -> None:
    x, weight, bias = torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(3)
    lora_a, lora_b, scales = torch.zeros(2, 1, 4), torch.zeros(2, 3, 1), torch.ones(2)
    for slot in (-1, 2):
        with pytest.raises(ValueError, match=f"slot {slot} is outside the adapters' 2 slots"):
            dense_lora_linear(x, weight, bias, lora_a, lora_b, scales, slot)
    for trainable in (weight.clone().requires_grad_(), bias.clone().requires_grad_()):
        base = (trainable, bias) if trainable.dim() == 2 else (weight, trainable)
        with pytest.raises(ValueError, match="frozen"):
            dense_lora_linear(x, *base, lora_a, lora_b, scales, 1)
    assert dense_lora_linear(x, weight, None, lora_a, lora_b, scales, 1).shape == (2, 3)


def test_gather_rows_torch_path_is_index_select_under_autograd() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, generator=gen, requires_grad=True)
    index = torch.tensor([2, 0, 2, 4])
    starts, sources = (torch.from_numpy(a) for a in inverse_index(index.numpy(), 5))
    y = gather_rows(x, index, starts, sources)
    assert torch.equal(y, x.detach().index_select(0, index))
    dy = torch.randn(4, 3, generator=gen)
    y.backward(dy)
    assert torch.equal(x.grad, torch.zeros(5, 3).index_add_(0, index, dy))


def test_rope_with_grad_torch_path_is_the_reference_rotation() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(3, 2, 8, generator=gen)
    cos, sin = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    got_q, got_k = rope_with_grad(q, k, cos, sin)
    want_q, want_k = qk_norm_rope_ref(q.detach(), k, cos, sin, None, None, 0.0)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    got_q.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_silu_mul_with_grad_refuses_operands_of_two_shapes_or_dtypes() -> None:
    gate = torch.zeros(2, 4)
    for up in (torch.zeros(2, 5), torch.zeros(2, 4, dtype=torch.float64)):
        for backend in ("torch", None):
            with pytest.raises(ValueError, match="one shape and dtype"):
                silu_mul_with_grad(gate, up, backend=backend)
