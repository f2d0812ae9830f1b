"""Tests of ``kernels.lora.sgmv`` (the host side of the segmented multi-LoRA ops): the launch config by shape, the
shrink workspace cut to what the meta holds and to whole K tiles, the output slices' and partial sums' layouts,
``add_lora_triton``'s argument checks and its meta checks, and ``sgmv_shrink``, ``sgmv_expand`` (adding, or storing
with zeros on rows without a slot) and ``expand_folded`` launched directly on small inputs against torch products
(CPU, Triton interpreter).
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import LoRAMeta, add_lora
from skyrl_clora.kernels.lora.sgmv import (
    _NO_SLICE,
    SgmvConfig,
    _slice_args,
    default_config,
    expand_folded,
    folded_h_layout,
    partials_layout,
    sgmv_expand,
    sgmv_shrink,
    shrink_workspace,
)
from tests.support.kernel_cases import make_problem
from tests.support.markers import interpreted

SLOTS = [0, 2, -1, 1, 0, -1]  # the direct launches' rows: three slots, two rows with none


def _meta(num_slots: int = 3, rank: int = 8, slices: int = 2) -> LoRAMeta:
    """A meta built for ``SLOTS`` (one launch of the build kernel)."""
    return LoRAMeta.for_batch(torch.tensor(SLOTS), num_slots, rank, slices)


def _bad_inputs() -> dict[str, tuple]:
    p = make_problem(8, 32, (16,), 3, 8, torch.float32, "uniform")
    args = (p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots)
    return {
        "x dtype": (p.out, p.x.double(), *args[2:]),
        "x stride": (p.out, torch.randn(32, 8).t(), *args[2:]),
        "out width": (p.out[:, :8], *args[1:]),
        "b not contiguous": (*args[:3], (p.lora_b[0].transpose(1, 2).contiguous().transpose(1, 2),), *args[4:]),
        "b rank": (*args[:3], (p.lora_b[0][:, :, :4].contiguous(),), *args[4:]),
        "too many slices": (torch.randn(8, 64), *args[1:3], p.lora_b * 4, *args[4:]),
        "scales dtype": (*args[:4], p.scales.double(), p.token_slots),
        "slots dtype": (*args[:5], p.token_slots.float()),
        "slots length": (*args[:5], p.token_slots[:4]),
    }


@interpreted
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_triton_wrapper_rejects_bad_inputs(case: str) -> None:
    with pytest.raises(ValueError):
        add_lora(*_bad_inputs()[case], backend="triton")


@interpreted
def test_meta_must_match_the_batch() -> None:
    p = make_problem(12, 32, (16,), 3, 8, torch.float32, "uniform")
    meta = LoRAMeta(max_tokens=16, num_slots=3, device="cpu")
    meta.build(p.token_slots[:10])
    with pytest.raises(ValueError, match="meta.build"):
        add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots, meta=meta, backend="triton")
    with pytest.raises(ValueError, match="max_tokens"):
        meta.build(torch.zeros(17, dtype=torch.int64))


def test_default_config_by_shape() -> None:
    """Decode (up to 256 rows): 16-row tiles and PDL; prefill: 64-row tiles, 8 warps from rank 32. Split-K doubles
    while the shrink has fewer than about two waves of programs (264) and every split keeps a whole K tile, and is at
    least what keeps a split to 512 (decode) or 2048 (prefill) features (but at most one split per K tile)."""
    small = default_config(16, 32, 4, 1, 16)
    assert (small.block_m, small.block_k, small.block_n, small.split_k, small.num_warps, small.pdl) == (16, 128, 128, 1, 4,
                                                                                                        True)
    assert default_config(8, 2560, 8, 3, 16).split_k == 16  # (1 + 8) tiles x 3 slices: 16 splits reach 264 programs
    prefill = default_config(4096, 4096, 8, 1, 64)
    assert (prefill.block_m, prefill.split_k, prefill.num_warps, prefill.pdl) == (64, 4, 8, False)
    assert default_config(4096, 4096, 8, 1, 16).num_warps == 4
    assert default_config(16384, 9728, 1, 1, 16).split_k == 5  # 257 tiles: 2 splits by programs, 5 by features
    assert default_config(16, 300, 1, 1, 16).split_k == 2  # 4 splits would leave a split without a K tile


def test_shrink_workspace_fits_the_meta_and_whole_k_tiles() -> None:
    meta = LoRAMeta(max_tokens=8, num_slots=2, device="cpu", max_rank=16, max_slices=1)  # 4 splits of 8 x 16 floats
    ws = shrink_workspace(meta, 8, 1000, 1, 16, SgmvConfig(block_k=128, split_k=16))
    assert ws.shape == (4, 1, 8, 16) and ws.data_ptr() == meta.workspace.data_ptr()
    assert shrink_workspace(meta, 8, 300, 1, 16, SgmvConfig(block_k=128, split_k=4)).shape == (3, 1, 8, 16)
    assert shrink_workspace(meta, 4, 1000, 2, 16, SgmvConfig(block_k=128, split_k=2)).shape == (2, 2, 4, 16)
    with pytest.raises(ValueError, match="larger max_rank or max_slices"):
        shrink_workspace(meta, 8, 1000, 3, 32, SgmvConfig())


def test_slice_args_pad_the_slices_to_three() -> None:
    b = (torch.zeros(3, 48, 8), torch.zeros(3, 16, 8))
    assert _slice_args(b, 32) == {
        "n0": 48, "n1": 16, "n2": 0, "col1": 48, "col2": 0, "nb1": 2, "nb2": _NO_SLICE, "ss0": 48 * 8, "ss1": 16 * 8,
        "ss2": 0, "total_blocks": 3,
    }  # fmt: skip


def test_partials_and_folded_h_layouts() -> None:
    """(split, slice, row, slot) element strides: the shrink's partials hold only each row's own slot; a folded
    GEMM's extra columns every slot, in one split."""
    assert partials_layout(torch.empty(2, 3, 5, 16)) == ((240, 80, 16, 0), 2)
    assert folded_h_layout(torch.empty(5, 3, 4, 8)) == ((0, 32, 96, 8), 1)


@interpreted
def test_sgmv_shrink_writes_every_split_and_no_row_without_a_slot() -> None:
    """Two A slices, 40 features in two K splits (the second partial); ``ws.sum(0)`` is each row's own slot's
    product, padded with zeros past the rank; rows with no slot keep what they held."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 40, generator=gen), torch.randn(2, 3, 8, 40, generator=gen)
    ws = torch.full((2, 2, 6, 16), 7.0)
    sgmv_shrink(ws, x, w, _meta(), 8, SgmvConfig(block_m=16, block_k=16, split_k=2))
    for t, s in enumerate(SLOTS):
        if s < 0:
            assert (ws[:, :, t] == 7.0).all()
            continue
        for a in range(2):
            torch.testing.assert_close(ws[:, a, t, :8].sum(0), x[t] @ w[a, s].T)
            assert ws[0, a, t, :8].abs().sum() > 0 and ws[1, a, t, :8].abs().sum() > 0, "both splits hold features"
        assert not ws[:, :, t, 8:].any()


def _expanded(ws_rows: torch.Tensor, weights: tuple[torch.Tensor, ...], scales: torch.Tensor | None) -> torch.Tensor:
    """``[T, sum(H_i)]``: each row's ``scales[s] * ws_rows[t, i] @ weights[i][s].T`` (0 for rows with no slot), from
    ``ws_rows: [T, slices, R]`` (one slice: shared by every weight)."""
    out = torch.zeros(len(SLOTS), sum(w.shape[1] for w in weights))
    for t, s in enumerate(SLOTS):
        if s >= 0:
            pieces = [ws_rows[t, i if ws_rows.shape[1] > 1 else 0] @ w[s].T for i, w in enumerate(weights)]
            out[t] = torch.cat(pieces) * (1.0 if scales is None else scales[s])
    return out


@interpreted
@pytest.mark.parametrize("store", [False, True], ids=["add", "store"])
def test_sgmv_expand_adds_or_stores_each_rows_slot(store: bool) -> None:
    """The partials of two splits summed, two output slices of one shared A, scales (or None: 1); adding leaves rows
    with no slot as they were, storing writes them zeros."""
    gen = torch.Generator().manual_seed(1)
    ws = torch.zeros(2, 1, 6, 16)
    ws[..., :8] = torch.randn(2, 1, 6, 8, generator=gen)
    weights = (torch.randn(3, 24, 8, generator=gen), torch.randn(3, 8, 8, generator=gen))
    scales = None if store else torch.tensor([0.5, 2.0, 1.5])
    out = torch.randn(6, 32, generator=gen)
    before = out.clone()
    sgmv_expand(out, ws, weights, scales, _meta(), 8, SgmvConfig(block_m=16, block_n=16), store=store)
    want = _expanded(ws.sum(0)[:, :, :8].transpose(0, 1), weights, scales) + (0 if store else before)
    torch.testing.assert_close(out, want)
    no_slot = torch.tensor(SLOTS) < 0
    assert torch.equal(out[no_slot], torch.zeros_like(out[no_slot]) if store else before[no_slot])


@interpreted
def test_expand_folded_reads_each_rows_own_slot() -> None:
    """``h: [T, slices, S, R]`` holds every slot's shrink of every row: each row adds its own slot's term, one A per
    slice; rows with no slot are left as they were."""
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(6, 2, 3, 8, generator=gen)
    weights = (torch.randn(3, 16, 8, generator=gen), torch.randn(3, 16, 8, generator=gen))
    scales = torch.tensor([0.5, 2.0, 1.5])
    out = torch.randn(6, 32, generator=gen)
    before = out.clone()
    expand_folded(out, h, weights, scales, _meta(), 8, SgmvConfig(block_m=16, block_n=16))
    own = h[torch.arange(6), :, torch.tensor(SLOTS).clamp(min=0)]  # [T, slices, R]: each row's own slot
    torch.testing.assert_close(out, before + _expanded(own, weights, scales))
