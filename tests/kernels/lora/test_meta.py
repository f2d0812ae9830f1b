"""Tests of ``kernels.lora.meta`` (``LoRAMeta``, the per-step grouping of a batch's rows by adapter slot): the build
kernel's stable counting sort with the null segment last (CPU, Triton interpreter), one meta reused by the layers of
a step and rebuilt for the next, the buffers' sizes, the checks of the constructor and of ``build``, the snapshot
a backward pass reads, ``for_batch``, and ``rank_pad``.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import LoRAMeta, add_lora
from skyrl_clora.kernels.lora.meta import ARRIVAL_BLOCKS, rank_pad
from tests.support.kernel_cases import LAYOUTS, make_problem, make_slots
from tests.support.lora_parity import check_add_lora as _check_add_lora
from tests.support.markers import interpreted


@interpreted
@pytest.mark.parametrize("layout", LAYOUTS)
def test_meta_build_groups_rows_by_slot(layout: str) -> None:
    gen = torch.Generator().manual_seed(1)
    slots = make_slots(layout, 300, 5, gen)  # more rows than one build chunk
    slots[7] = 5  # out of range: treated as no adapter
    meta = LoRAMeta(max_tokens=512, num_slots=5, device="cpu")
    meta.build(slots)
    for s in range(5):
        rows = (slots == s).nonzero().flatten()
        start, count = meta.seg_start[s].item(), meta.seg_count[s].item()
        assert count == rows.numel()
        assert torch.equal(meta.sorted_rows[start : start + count].long(), rows)
    assert meta.seg_start.tolist() == (meta.seg_count.cumsum(0) - meta.seg_count).tolist()
    no_adapter = ((slots < 0) | (slots >= 5)).nonzero().flatten()  # the null segment comes last
    assert torch.equal(meta.sorted_rows[300 - no_adapter.numel() : 300].long(), no_adapter)


@interpreted
def test_meta_is_reused_across_layers_and_rebuilt_per_step() -> None:
    meta = LoRAMeta(max_tokens=64, num_slots=4, device="cpu", max_rank=16, max_slices=3)
    for step, num_tokens in enumerate((20, 33)):
        layers = [
            make_problem(num_tokens, 32, (48, 16, 16), 4, 16, torch.float32, "uniform", per_slice_a=True, seed=step),
            make_problem(num_tokens, 48, (32,), 4, 8, torch.float32, "uniform", seed=step),
        ]
        layers[1].token_slots = layers[0].token_slots
        meta.build(layers[0].token_slots)
        for p in layers:
            run = lambda q: add_lora(q.out, q.x, q.lora_a, q.lora_b, q.scales, q.token_slots, meta=meta, backend="triton")
            _check_add_lora(p, run)


def test_rank_pad_is_a_power_of_two_of_at_least_16() -> None:
    assert [rank_pad(r) for r in (1, 8, 16, 17, 33, 64, 65)] == [16, 16, 16, 32, 64, 64, 128]


def test_buffers_are_sized_once_and_sizes_must_be_positive() -> None:
    meta = LoRAMeta(max_tokens=10, num_slots=3, device="cpu", max_rank=20, max_slices=2)
    assert meta.sorted_rows.shape == (10,) and meta.sorted_rows.dtype == torch.int32
    assert meta.seg_start.shape == meta.seg_count.shape == (3,)
    assert meta.workspace.numel() == 4 * 2 * 10 * 32  # 4 splits x slices x tokens x rank_pad(max_rank)
    assert meta.arrivals.shape == (3 * ARRIVAL_BLOCKS,) and not meta.arrivals.any()
    assert meta.num_tokens == 0 and meta.device == torch.device("cpu")
    for sizes in ((0, 3), (10, 0), (10, 3, 0), (10, 3, 8, 0)):
        with pytest.raises(ValueError, match="must be positive"):
            LoRAMeta(*sizes[:2], "cpu", *sizes[2:])


def test_build_rejects_bad_token_slots() -> None:
    meta = LoRAMeta(max_tokens=8, num_slots=3, device="cpu")
    for slots, message in [
        (torch.zeros(2, 2, dtype=torch.int64), "1-D int32/int64"),
        (torch.zeros(4), "1-D int32/int64"),
        (torch.zeros(4, dtype=torch.int64, device="meta"), "is on meta"),
        (torch.zeros(8, dtype=torch.int64)[::2], "contiguous"),
        (torch.zeros(9, dtype=torch.int64), "exceed this LoRAMeta's max_tokens=8"),
    ]:
        with pytest.raises(ValueError, match=message):
            meta.build(slots)
    assert meta.num_tokens == 0


@interpreted
def test_snapshot_keeps_the_built_rows_until_the_next_build() -> None:
    """One snapshot per build, shared by every caller: copies of the index buffers (no workspace; the arrival
    counters shared), unchanged by the next build, which makes a new one."""
    meta = LoRAMeta(max_tokens=8, num_slots=3, device="cpu")
    meta.build(torch.tensor([2, 0, -1, 2, 1]))
    snap = meta.snapshot()
    assert meta.snapshot() is snap
    assert snap.sorted_rows.tolist() == [1, 4, 0, 3, 2] and snap.seg_count.tolist() == [1, 1, 2]
    assert snap.seg_start.tolist() == [0, 1, 2] and snap.num_tokens == 5
    assert snap.workspace.numel() == 0 and snap.arrivals is meta.arrivals
    meta.build(torch.tensor([1, 1, 0]))
    assert meta.snapshot() is not snap
    assert snap.sorted_rows.tolist() == [1, 4, 0, 3, 2] and snap.seg_count.tolist() == [1, 1, 2]
    assert meta.snapshot().sorted_rows.tolist() == [2, 0, 1] and meta.snapshot().seg_count.tolist() == [1, 2, 0]


@interpreted
def test_for_batch_sizes_a_meta_to_the_batch() -> None:
    meta = LoRAMeta.for_batch(torch.tensor([1, -1, 1, 0, 1]), 3, 8, 2)
    assert (meta.max_tokens, meta.num_tokens, meta.num_slots, meta.max_rank) == (5, 5, 3, 8)
    assert meta.seg_count.tolist() == [1, 3, 0] and meta.sorted_rows[:5].tolist() == [3, 0, 2, 4, 1]
    assert meta.workspace.numel() == 4 * 2 * 5 * 16
    empty = LoRAMeta.for_batch(torch.zeros(0, dtype=torch.int64), 3, 8, 1)
    assert empty.max_tokens == 1 and empty.num_tokens == 0 and empty.seg_count.tolist() == [0, 0, 0]
