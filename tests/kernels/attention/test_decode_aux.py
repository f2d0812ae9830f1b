"""Tests of ``kernels.attention.decode_aux`` (the decode attention's kernels around its partials): the shared-prefix
group tables (``_prefix_groups_kernel``: each member's served prefix length among the first ``MEMBERS`` rows naming
a source in the batch, the members' rows, the sources' counts) and the reduce (``_reduce_kernel``: the written
partials merged by their log-sum-exps, the prefix slots of a served row, zeros for a row of length 0), launched
directly on small tables through the Triton interpreter against Python computations; and ``reduce_warps``.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels.attention.decode_aux import _prefix_groups_kernel, _reduce_kernel, reduce_warps
from skyrl_clora.kernels.launch import next_power_of_2
from tests.support.markers import interpreted


def test_reduce_warps_one_per_thousand_floats_of_the_tile() -> None:
    """The engine's shape (6 slots padded to 8, d=128) gets one warp; long caches' tiles more, at most 8."""
    assert reduce_warps(8, 128) == 1
    assert reduce_warps(4, 16) == 1
    assert reduce_warps(16, 128) == 2
    assert reduce_warps(128, 256) == 8


@interpreted
def test_prefix_groups_serve_the_first_members_of_each_source() -> None:
    """Rows 0, 1 and 2 name row 0 (row 0 itself; row 1's prefix of 45 is cut to its length, itself cut to ``L =
    38``): with two members per tile rows 0 and 1 are served, row 2 reads its prefix itself. Row 3 names a row outside
    the batch and row 4 has no prefix: neither is served. Row 0 counts two members."""
    B, L, members = 5, 38, 2
    lengths = torch.tensor([50, 40, 30, 60, 20])
    prefix_rows = torch.tensor([0, 0, 0, 7, 1])
    prefix_lens = torch.tensor([37, 45, 20, 10, 0])
    served = torch.full((B,), -1, dtype=torch.int32)
    count = torch.full((B,), -1, dtype=torch.int32)
    member_rows = torch.full((B * members,), -1, dtype=torch.int32)
    _prefix_groups_kernel[(B,)](lengths, prefix_rows, prefix_lens, served, count, member_rows, B, L,
                                B_P2=next_power_of_2(B), MEMBERS=members)
    assert served.tolist() == [37, 38, 0, 0, 0]
    assert count.tolist() == [2, 0, 0, 0, 0]
    assert member_rows.tolist() == [0, 1] + [-1] * 8


def _merged(o: torch.Tensor, lse: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """``sum_s 2**lse[s] * o[s] / sum_s 2**lse[s]`` over ``slots`` (float64; zeros for no slot)."""
    if not slots:
        return torch.zeros(o.shape[-1], dtype=torch.float64)
    weights = torch.exp2(lse[slots].double())
    return (weights[:, None] * o[slots].double()).sum(0) / weights.sum()


@interpreted
@pytest.mark.parametrize("has_prefix", [False, True], ids=["own-rows", "prefix-rows"])
def test_reduce_merges_the_written_slots_of_each_row(has_prefix: bool) -> None:
    """Three 32-key splits (``L = 96``): row 0 (length 0) gets zeros, row 1 (length 40) its first two splits, row 2
    all three, and with prefixes the prefix slots below each row's served length (row 1: 20, one slot; row 2: 70,
    three). Slots a row does not use hold NaN partials (never read); a used slot of ``-inf`` gets no weight."""
    B, H, D, split_len, num_splits = 3, 2, 16, 32, 3
    num_slots = num_splits * (2 if has_prefix else 1)
    gen = torch.Generator().manual_seed(3)
    lse = torch.randn(B, H, num_slots, generator=gen) * 2
    o = torch.randn(B, H, num_slots, D, generator=gen)
    lengths, served = torch.tensor([0, 40, 96]), torch.tensor([0, 20, 70], dtype=torch.int32)
    used = {0: [], 1: [0, 1], 2: [0, 1, 2]}
    if has_prefix:
        used = {0: [], 1: [0, 1, 3], 2: [0, 1, 2, 3, 4, 5]}
    lse[2, :, 1] = float("-inf")
    used[2].remove(1)
    for b in range(B):
        unused = [s for s in range(num_slots) if s not in used[b]]
        o[b, :, unused] = float("nan")
    out = torch.full((B, H, D), 7.0)
    _reduce_kernel[(H, B)](o, lse, lengths, served, out, H, D, num_splits * split_len, num_splits, num_slots,
                           out.stride(0), out.stride(1), SPLIT_LEN=split_len, SLOTS_P2=next_power_of_2(num_slots),
                           BLOCK_D=D, PDL=False, HAS_PREFIX=has_prefix)
    for b in range(B):
        for h in range(H):
            torch.testing.assert_close(out[b, h].double(), _merged(o[b, h], lse[b, h], used[b]), rtol=1e-5, atol=1e-6)
