"""Tests of ``kernels.reference``'s decode attention (``decode_attention_ref``, the CPU path of
``dispatch.decode_attention``): against a plain float64 loop over GQA shapes, ``out`` written and rows of length 0
zeroed, a row's bits independent of the batch, and the paged reference bit-identical to the slot reference on each
row's gathered blocks (with and without shared prefixes). Kept beside tests/kernels/test_reference.py because the
prefill reference's tests (test_reference_prefill_attention.py) share these tests' names.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import decode_attention
from tests.support.attention_checks import relative_error as _err
from tests.support.kernel_cases import TOLERANCE, attention_loop_ref, make_attention_problem
from tests.support.paged_cases import gather_cache, make_paged_decode_problem


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
def test_reference_matches_loop(kv_heads: int) -> None:
    p = make_attention_problem(6, 4, kv_heads, 40, 16, torch.float32, cache_rows=8, seed=kv_heads)
    want = attention_loop_ref(p)
    assert (want[0] - want[1]).abs().max() > 1e-2, "rows with different lengths must give different outputs"
    got = decode_attention(p.q, p.k_cache, p.v_cache, p.lengths)
    assert _err(got, want) < 1e-5


def test_reference_writes_out_and_zeros_empty_rows() -> None:
    p = make_attention_problem(3, 4, 2, 16, 8, torch.float32)
    p.lengths[2] = 0
    out = torch.full_like(p.q, 7.0)
    assert decode_attention(p.q, p.k_cache, p.v_cache, p.lengths, out=out, backend="torch") is out
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert _err(out[:2], attention_loop_ref(p)[:2]) < 1e-5


def test_reference_rows_do_not_depend_on_the_batch() -> None:
    """The CPU engine's path: a row's output is bit-identical whether 32 rows are decoded or 16 (the
    engine decodes whole 16-row quanta)."""
    p = make_attention_problem(32, 4, 2, 256, 32, torch.float32, seed=9)
    full = decode_attention(p.q, p.k_cache, p.v_cache, p.lengths)
    part = decode_attention(p.q[:16], p.k_cache, p.v_cache, p.lengths[:16])
    assert torch.equal(full[:16], part)


@pytest.mark.parametrize("with_prefix", [False, True], ids=["own-rows", "prefix-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_paged_reference_is_the_slot_reference_on_the_gathered_cache(block_size: int, dtype: torch.dtype,
                                                                     with_prefix: bool) -> None:
    """Row by row bit for bit (the CPU engine's runs stay reproducible): a row of a paged call equals a slot
    call of that row alone over its own blocks gathered (its length rounded up to whole blocks), over randomly
    placed blocks, blocks shared by rows, garbage table entries past each row's keys; and within rounding of
    the float64 loop."""
    pp = make_paged_decode_problem(4, 2, 16, dtype, block_size, with_prefix, seed=block_size)
    paged, p = pp.clean_paged(), pp.slot
    got = decode_attention(p.q, paged.k_cache, paged.v_cache, p.lengths, block_tables=paged.block_tables,
                           prefix_rows=pp.prefix_rows, prefix_lens=pp.prefix_lens)
    gathered_k, gathered_v = (gather_cache(c, paged.block_tables) for c in (paged.k_cache, paged.v_cache))
    for b in range(p.q.shape[0]):
        width = -(-min(int(p.lengths[b]), gathered_k.shape[2]) // block_size) * block_size
        # Row b first (the slot call's row 0), then every row, so that prefix rows keep their places (shifted by 1).
        k, v = (torch.cat([c[b : b + 1], c])[:, :, :width] for c in (gathered_k, gathered_v))
        prefix = {} if pp.prefix_rows is None else {"prefix_rows": pp.prefix_rows[b : b + 1] + 1,
                                                    "prefix_lens": pp.prefix_lens[b : b + 1]}
        assert torch.equal(got[b : b + 1], decode_attention(p.q[b : b + 1], k, v, p.lengths[b : b + 1], **prefix)), b
    assert _err(got, attention_loop_ref(p)) < (1e-5 if dtype == torch.float32 else TOLERANCE[dtype])
