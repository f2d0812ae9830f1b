"""Tests of ``kernels.lora.folded`` (multi-LoRA layers with their slots' A folded into the base weight): the layer's
output against the base layer plus the fp32 ``add_lora`` reference, on the CPU through the Triton interpreter, on
both Triton paths (the folded GEMM with one expand, and the base GEMM with shrink and expand); in-place publishes
into ``lora_a`` reach the folded GEMM; the fold-pays rule; the folded storage and its checks; the meta of a folded
layer's batch. tests/gpu/ repeats the parity at real sizes and in a CUDA graph. Tolerances per dtype:
``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

import skyrl_clora.kernels.dispatch as dispatch
from skyrl_clora.kernels import LoRAMeta, fold_lora_weights, folded_lora_linear
from skyrl_clora.kernels.lora.folded import fold_pays, folded_meta
from tests.support.kernel_cases import (
    LAYOUTS,
    TOLERANCE,
    adapters_differ,
    fold_problem,
    make_problem,
    reference_out,
    rel_error,
)
from tests.support.markers import interpreted


SHAPES = {"qkv": ((48, 16, 16), True), "gate_up": ((32, 32), True), "shared_a": ((32, 32), False), "one": ((40,), False)}


@interpreted
@pytest.mark.parametrize("fold", [True, False], ids=["folded-gemm", "base-gemm-and-shrink"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_folded_layer_matches_base_layer_plus_reference(layout: str, shape: str, rank: int, dtype: torch.dtype,
                                                        fold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    widths, per_slice_a = SHAPES[shape]
    # h_in=80 is not a multiple of the K tiles; 24 rows leave a partial row tile
    p = make_problem(24, 80, widths, num_slots=4, rank=rank, dtype=dtype, layout=layout, per_slice_a=per_slice_a, seed=rank)
    folded = fold_problem(p, with_bias=shape == "qkv", seed=rank)
    if p.token_slots.unique().ge(0).sum() > 1:
        assert adapters_differ(p), "adapters give equal outputs: the parity test would be vacuous"
    monkeypatch.setattr(dispatch, "fold_pays", lambda *shape: fold)
    meta = LoRAMeta(max_tokens=32, num_slots=4, device="cpu", max_rank=rank, max_slices=3)
    meta.build(p.token_slots)
    got = folded_lora_linear(p.x, folded, p.lora_b, p.scales, p.token_slots, meta=meta, backend="triton")
    want = reference_out(p)
    assert got.shape == p.out.shape and got.stride(1) == 1
    err = rel_error(got, want, p.out)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    base_only = p.token_slots < 0
    torch.testing.assert_close(got[base_only], p.out[base_only])


@interpreted
def test_publishes_into_lora_a_reach_the_folded_gemm() -> None:
    p = make_problem(16, 32, (32,), num_slots=3, rank=8, dtype=torch.float32, layout="uniform")
    folded = fold_problem(p, with_bias=False)
    folded.lora_a[1].copy_(torch.randn(8, 32))  # an in-place publish into slot 1, as the engine's sync does
    assert folded.lora_a.data_ptr() == folded.weight[32:].data_ptr()
    p.lora_a = folded.lora_a
    got = folded_lora_linear(p.x, folded, p.lora_b, p.scales, p.token_slots, backend="triton")
    assert rel_error(got, reference_out(p), p.out) < TOLERANCE[torch.float32]


def test_fold_pays_by_rows_and_extra_columns() -> None:
    assert fold_pays(256, 6144, 3 * 32 * 16)  # decode: a quarter of the base columns may be added
    assert not fold_pays(256, 2560, 32 * 64)
    assert fold_pays(4096, 19456, 2 * 8 * 16)  # prefill: at most 256 columns, whatever the base width
    assert not fold_pays(4096, 6144, 3 * 8 * 16)


def test_fold_rejects_mismatched_lora_a() -> None:
    weight = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"lora_a must be \[slices, S, R, 16\]"):
        fold_lora_weights(weight, None, torch.zeros(2, 4, 16))
    folded = fold_lora_weights(weight, torch.ones(8), torch.zeros(1, 2, 4, 16))
    assert folded.weight.shape == (16, 16) and folded.bias.tolist() == [1.0] * 8 + [0.0] * 8
    assert torch.equal(folded.base_weight, weight) and folded.extra_features == 8


def test_folded_views_share_the_weight_storage() -> None:
    """``base_weight``, ``base_bias`` and ``lora_a`` are views of the folded tensors: ``[slices, S, R, H_in]``, or
    ``[S, R, H_in]`` for one A shared by every slice."""
    weight, bias = torch.randn(6, 4), torch.randn(6)
    lora_a = torch.randn(3, 2, 5, 4)
    folded = fold_lora_weights(weight, bias, lora_a)
    assert folded.lora_a.shape == (3, 2, 5, 4) and torch.equal(folded.lora_a, lora_a)
    assert folded.lora_a.data_ptr() == folded.weight[6:].data_ptr()
    assert torch.equal(folded.base_weight, weight) and torch.equal(folded.base_bias, bias)
    assert folded.extra_features == 3 * 2 * 5 and folded.out_features == 6
    shared = fold_lora_weights(weight, None, lora_a[:1])
    assert shared.lora_a.shape == (2, 5, 4) and shared.bias is None and shared.base_bias is None


@interpreted
def test_folded_meta_builds_one_for_the_batch_or_checks_the_given_one() -> None:
    p = make_problem(10, 16, (8,), num_slots=3, rank=4, dtype=torch.float32, layout="no_adapter")
    folded = fold_problem(p, with_bias=False)
    meta = folded_meta(folded, p.x, p.token_slots, None)
    assert meta.num_tokens == 10 and meta.num_slots == 3
    assert meta.seg_count.tolist() == torch.bincount(p.token_slots[p.token_slots >= 0], minlength=3).tolist()
    assert folded_meta(folded, p.x, p.token_slots, meta) is meta
    other = LoRAMeta(max_tokens=16, num_slots=3, device="cpu")
    other.build(p.token_slots[:7])
    with pytest.raises(ValueError, match="meta.build"):
        folded_meta(folded, p.x, p.token_slots, other)
