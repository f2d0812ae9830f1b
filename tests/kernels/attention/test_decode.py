"""Tests of ``kernels.attention.decode`` (flash-decoding over a slot or paged KV cache): the Triton kernels (through
the Triton interpreter, ``TRITON_INTERPRET=1``, set by scripts/test.sh) against a plain float64 loop and the torch
reference at small sizes, over GQA shapes, dtypes, fp8 caches, launch configs, shared prefixes (groups larger than
a tile, sources outside the batch), paged caches with garbage table entries, batch independence, ``out`` and a
workspace given, the argument checks, the register cap and the default config; the shared-prefix and paged cases
on the torch path too; and the partials kernel's GPU specialisations compile for sm_90 (``sm90_compile``).
tests/gpu/test_attention_gpu.py repeats the parity at real sizes. Relative-error tolerances per dtype:
``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import DecodeWorkspace, decode_attention
from skyrl_clora.kernels.attention.decode import (
    PREFIX_GROUP_ROWS,
    PREFIX_MAXNREG,
    AttentionConfig,
    _register_cap,
    decode_attention_triton,
    default_attention_config,
)
from skyrl_clora.kernels.reference import decode_attention_ref
from tests.support.attention_checks import relative_error as _err
from tests.support.kernel_cases import (
    CACHE_DTYPES,
    DTYPES,
    FP8,
    TOLERANCE,
    as_cache,
    attention_loop_ref,
    make_attention_problem,
)
from tests.support.markers import interpreted
from tests.support.paged_cases import PROMPT_LEN, make_paged_decode_problem
from tests.support.sm90_compile_runs import sm90_compile_test

test_compiles_for_sm90 = sm90_compile_test("skyrl_clora.kernels.attention.decode")


@interpreted
@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("head_dim", [16, 32, 24])
def test_triton_matches_reference(head_dim: int, kv_heads: int, dtype: torch.dtype, cache: torch.dtype | None) -> None:
    """Default config (three 512-key splits at L=1100); cache positions past each length and cache rows
    past B hold NaN, so reading any of them would show. An fp8 cache against the loop on its dequantised
    values (exact in ``dtype``): the dtype's tolerance."""
    p = make_attention_problem(5, 4, kv_heads, 1100, head_dim, dtype, cache_rows=7, seed=head_dim + kv_heads, poison=True,
                               cache_values=cache)
    want = attention_loop_ref(p)
    got = decode_attention(p.q, as_cache(p.k_cache, cache), as_cache(p.v_cache, cache), p.lengths, backend="triton")
    assert got.dtype == dtype and got.shape == p.q.shape
    assert _err(got, want) < TOLERANCE[dtype], f"relative error {_err(got, want):.2e}"


def _shared_prefix_problem(dtype: torch.dtype, cache_values: torch.dtype | None = None):
    """Rows 1, 2 and 4 share row 0's first 37 positions (row 4 only 20 of them, row 3 none): returns the
    problem whose members' own prefix positions hold NaN, the prefix arguments, and the attention the
    members would get with row 0's prefix copied into their rows."""
    from dataclasses import replace

    p = make_attention_problem(5, 4, 2, 70, 16, dtype, seed=11, lengths=[45, 60, 38, 50, 64], cache_values=cache_values)
    prefix_rows = torch.tensor([0, 0, 0, 3, 0])
    prefix_lens = torch.tensor([37, 37, 37, 0, 20])
    copied_k, copied_v = p.k_cache.clone(), p.v_cache.clone()
    for row, length in enumerate(prefix_lens.tolist()):
        copied_k[row, :, :length] = p.k_cache[0, :, :length]
        copied_v[row, :, :length] = p.v_cache[0, :, :length]
        if row:
            p.k_cache[row, :, :length] = float("nan")
            p.v_cache[row, :, :length] = float("nan")
    want = attention_loop_ref(replace(p, k_cache=copied_k, v_cache=copied_v))
    return p, prefix_rows, prefix_lens, want


@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefix_rows_read_the_shared_copy(backend: str, dtype: torch.dtype, cache: torch.dtype | None) -> None:
    """Members read their prefix from the shared row (their own prefix positions are NaN), across key blocks
    and splits (37 keys: two 16-key blocks and part of a third; 32-key splits), and their own keys after it;
    an fp8 cache gives what the model-dtype cache of its dequantised values gives."""
    p, prefix_rows, prefix_lens, want = _shared_prefix_problem(dtype, cache)
    assert (want[1] - attention_loop_ref(p)[1]).isnan().all(), "the members' own prefix must be unusable"
    config = {"config": AttentionConfig(split_len=32, block_n=16)} if backend == "triton" else {}
    call = decode_attention_triton if backend == "triton" else decode_attention_ref
    got = call(p.q, as_cache(p.k_cache, cache), as_cache(p.v_cache, cache), p.lengths, prefix_rows=prefix_rows,
               prefix_lens=prefix_lens, **config)
    assert got.dtype == dtype
    assert _err(got, want) < TOLERANCE[dtype], f"relative error {_err(got, want):.2e}"


@interpreted
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
def test_prefix_groups_larger_than_a_tile_and_sources_outside_the_batch(kv_heads: int) -> None:
    """Eleven rows name row 0 (more than ``PREFIX_GROUP_ROWS``: the last three read their prefix in their own
    programs), with prefix lengths ending inside key blocks and splits, one of them longer than the source's
    own; row 11 names cache row 13, past the batch. Every member's own prefix positions are NaN."""
    from dataclasses import replace

    lengths = [50, 60, 38, 45, 64, 41, 52, 70, 33, 66, 47, 58]
    p = make_attention_problem(12, 4, kv_heads, 70, 16, torch.float32, cache_rows=14, seed=5, lengths=lengths)
    prefix_rows = torch.tensor([0] * 11 + [13])
    prefix_lens = torch.tensor([37, 37, 20, 45, 37, 3, 37, 0, 33, 37, 37, 40])
    assert PREFIX_GROUP_ROWS < int((prefix_lens[:11] > 0).sum()), "the group must overflow one tile"
    copied_k, copied_v = p.k_cache.clone(), p.v_cache.clone()
    for row, (source, length) in enumerate(zip(prefix_rows.tolist(), prefix_lens.tolist())):
        copied_k[row, :, :length] = p.k_cache[source, :, :length]
        copied_v[row, :, :length] = p.v_cache[source, :, :length]
        if row != source:
            p.k_cache[row, :, :length] = float("nan")
            p.v_cache[row, :, :length] = float("nan")
    want = attention_loop_ref(replace(p, k_cache=copied_k, v_cache=copied_v))
    assert (want[1] - want[4]).abs().max() > 1e-2, "members must get different outputs"
    workspace = DecodeWorkspace(12, 4, 1200, 16, "cpu")  # 1200 positions: as many 512-key splits as 32-key ones at 70
    workspace.buffer.fill_(float("nan"))  # partials this call does not write must not be read
    got = decode_attention_triton(p.q, p.k_cache, p.v_cache, p.lengths, prefix_rows=prefix_rows, prefix_lens=prefix_lens,
                                  workspace=workspace, config=AttentionConfig(split_len=32, block_n=16))
    assert _err(got, want) < TOLERANCE[torch.float32], f"relative error {_err(got, want):.2e}"
    # The group programs read the prefix of the first eight members (by row) of row 0's group, no other.
    assert workspace.groups[:12].tolist() == [37, 37, 20, 45, 37, 3, 37, 0, 33, 0, 0, 0]


@interpreted
@pytest.mark.parametrize("config", [AttentionConfig(split_len=32, block_n=16), AttentionConfig(split_len=128, block_n=32)])
def test_triton_configs_match_reference(config: AttentionConfig) -> None:
    """Several key blocks per split (length 33: one key into a second split), and one split longer than
    the cache."""
    p = make_attention_problem(4, 8, 2, 70, 32, torch.float32, seed=3, poison=True, lengths=[1, 70, 33, 13])
    got = decode_attention_triton(p.q, p.k_cache, p.v_cache, p.lengths, config=config)
    assert _err(got, attention_loop_ref(p)) < TOLERANCE[torch.float32]


@interpreted
def test_triton_rows_do_not_depend_on_the_batch() -> None:
    """A row's output is bit-identical whether it is decoded with 5 rows or 2 (the launch config depends on
    the cache length only)."""
    p = make_attention_problem(5, 4, 2, 300, 16, torch.bfloat16, seed=9)
    full = decode_attention(p.q, p.k_cache, p.v_cache, p.lengths, backend="triton")
    part = decode_attention(p.q[:2], p.k_cache, p.v_cache, p.lengths[:2], backend="triton")
    assert torch.equal(full[:2], part)


@interpreted
def test_triton_writes_out_with_workspace_and_strided_q() -> None:
    """q as the engine holds it (``[B, H, 1, d][:, :, 0]``), ``out`` and a workspace given; a zero length
    gives zeros; a workspace too small for the call is refused."""
    p = make_attention_problem(3, 4, 2, 48, 16, torch.float32, seed=4)
    q = torch.zeros(3, 4, 2, 16)
    q[:, :, 1] = p.q
    p.lengths[2] = 0
    out = torch.full_like(p.q, 7.0)
    ws = DecodeWorkspace(max_rows=3, num_heads=4, max_len=48, head_dim=16, device="cpu")
    got = decode_attention(q[:, :, 1], p.k_cache, p.v_cache, p.lengths, out=out, workspace=ws, backend="triton")
    assert got is out
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert _err(out[:2], attention_loop_ref(p)[:2]) < TOLERANCE[torch.float32]
    small = DecodeWorkspace(max_rows=1, num_heads=4, max_len=48, head_dim=16, device="cpu")
    with pytest.raises(ValueError, match="DecodeWorkspace"):
        decode_attention(p.q, p.k_cache, p.v_cache, p.lengths, workspace=small, backend="triton")


@interpreted
def test_triton_rejects_bad_arguments() -> None:
    p = make_attention_problem(2, 4, 2, 16, 16, torch.float32)
    cases = [
        ((p.q, p.k_cache[:, :1].expand(2, 3, 16, 16), p.v_cache[:, :1].expand(2, 3, 16, 16), p.lengths), "multiple"),
        ((p.q.half(), p.k_cache, p.v_cache, p.lengths), "one dtype"),
        ((p.q, p.k_cache.to(FP8), p.v_cache, p.lengths), "one dtype"),  # fp8 for both caches or neither
        ((p.q, p.k_cache.to(torch.float8_e5m2), p.v_cache.to(torch.float8_e5m2), p.lengths), "one dtype"),
        ((p.q, p.k_cache, p.v_cache, p.lengths.float()), "int32/int64"),
        ((p.q, p.k_cache[:1], p.v_cache[:1], p.lengths), "cache has 1 rows"),
        ((p.q, p.k_cache.transpose(2, 3), p.v_cache.transpose(2, 3), p.lengths), "unit stride"),
        ((torch.zeros(2, 4, 320), torch.zeros(2, 2, 4, 320), torch.zeros(2, 2, 4, 320), p.lengths), "backend='torch'"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            decode_attention(*args, backend="triton")
    assert torch.allclose(decode_attention_ref(p.q, p.k_cache, p.v_cache, p.lengths).double(), attention_loop_ref(p))


def test_register_cap_only_for_shared_prefixes_on_the_gpu() -> None:
    """The partials kernel's ``maxnreg``: the prefix cap by default with shared prefixes at head dims up to
    128, none without prefixes, for wider heads, on the CPU, or with ``maxnreg=0``; an explicit cap wins."""
    default = AttentionConfig()
    assert _register_cap(default, True, 128, False) == {"maxnreg": PREFIX_MAXNREG}
    assert _register_cap(default, False, 128, False) == {}
    assert _register_cap(default, True, 256, False) == {}
    assert _register_cap(default, True, 128, True) == {}
    assert _register_cap(AttentionConfig(maxnreg=0), True, 128, False) == {}
    assert _register_cap(AttentionConfig(maxnreg=128), False, 256, False) == {"maxnreg": 128}


# Paged caches (tests/support/paged_cases.py): (block size, config) per case. Default config: 64-key tiles spanning
# four 16-position blocks, two 32-position ones or one 64-position block; 16-key tiles over 32- and 64-position
# blocks (a part of one block per tile) with 32-key splits; 32-key tiles and 128-key splits over 16-position blocks.
PAGED_CASES = [
    (16, None),
    (32, None),
    (64, None),
    (32, AttentionConfig(split_len=32, block_n=16)),
    (64, AttentionConfig(split_len=32, block_n=16)),
    (16, AttentionConfig(split_len=128, block_n=32)),
]


@interpreted
@pytest.mark.parametrize("with_prefix", [False, True], ids=["own-rows", "prefix-rows"])
@pytest.mark.parametrize("block_size,config", PAGED_CASES, ids=lambda c: repr(c) if c is None or isinstance(c, int) else f"n{c.block_n}")
def test_paged_triton_matches_reference(block_size: int, config: AttentionConfig | None, with_prefix: bool) -> None:
    """Paged Triton against the float64 loop on the slot cache, and against the paged reference: positions past
    each row's keys, blocks no row names and garbage table entries (-1, stale, 2**30) would show as NaN or a
    crash. With prefixes, rows 3 and 4 form row 1's group (one prefix program), rows 1 and 2 read the prompt
    through table row 5, past the batch (in their own programs), and the own entries of whole blocks below a
    member's prefix are garbage (rows 2, 3, 4)."""
    pp = make_paged_decode_problem(4, 2, 16, torch.float32, block_size, with_prefix, seed=block_size + 1)
    # The default config's workspace for L = M * BS = 192; 32-key splits need as many as 512-key ones at 3072.
    workspace = DecodeWorkspace(5, 4, 192 if config is None else 3072, 16, "cpu")
    workspace.buffer.fill_(float("nan"))  # partials this call does not write must not be read
    got = decode_attention_triton(pp.slot.q, pp.paged.k_cache, pp.paged.v_cache, pp.slot.lengths, workspace=workspace,
                                  config=config, prefix_rows=pp.prefix_rows, prefix_lens=pp.prefix_lens,
                                  block_tables=pp.paged.block_tables)
    assert _err(got, attention_loop_ref(pp.slot)) < TOLERANCE[torch.float32], f"relative error {_err(got, attention_loop_ref(pp.slot)):.2e}"
    clean = pp.clean_paged()
    want = decode_attention_ref(pp.slot.q, clean.k_cache, clean.v_cache, pp.slot.lengths, prefix_rows=pp.prefix_rows,
                                prefix_lens=pp.prefix_lens, block_tables=clean.block_tables)
    assert _err(got, want) < TOLERANCE[torch.float32]
    if with_prefix:
        assert workspace.groups[:5].tolist() == [0, 0, 0, 100, PROMPT_LEN], "rows 3 and 4 read their prefix in row 1's group"


@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("with_prefix", [False, True], ids=["own-rows", "prefix-rows"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_paged_half_precision(dtype: torch.dtype, backend: str, with_prefix: bool, cache: torch.dtype | None) -> None:
    """Paged, with and without shared prefixes, in the half dtypes; an fp8 cache against the loop on its
    dequantised values (the torch path reads the NaN-free cache, as it reads every gathered position)."""
    pp = make_paged_decode_problem(8, 2, 32, dtype, 32, with_prefix=with_prefix, seed=2, cache_values=cache)
    paged = pp.paged if backend == "triton" else pp.clean_paged()
    got = decode_attention(pp.slot.q, as_cache(paged.k_cache, cache), as_cache(paged.v_cache, cache), pp.slot.lengths,
                           prefix_rows=pp.prefix_rows, prefix_lens=pp.prefix_lens, block_tables=paged.block_tables,
                           backend=backend)
    assert got.dtype == dtype
    assert _err(got, attention_loop_ref(pp.slot)) < TOLERANCE[dtype], f"relative error {_err(got, attention_loop_ref(pp.slot)):.2e}"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
def test_paged_rows_do_not_depend_on_the_batch(backend: str) -> None:
    """A row's output is bit-identical whether it is decoded with 5 rows or 2 (a table of 6 rows either way)."""
    pp = make_paged_decode_problem(4, 2, 16, torch.bfloat16, 32, with_prefix=False, seed=6)
    paged = pp.clean_paged() if backend == "torch" else pp.paged
    args = (paged.k_cache, paged.v_cache)
    full = decode_attention(pp.slot.q, *args, pp.slot.lengths, block_tables=paged.block_tables, backend=backend)
    part = decode_attention(pp.slot.q[:2], *args, pp.slot.lengths[:2], block_tables=paged.block_tables, backend=backend)
    assert torch.equal(full[:2], part)


@interpreted
def test_paged_triton_rejects_bad_tables() -> None:
    pp = make_paged_decode_problem(4, 2, 16, torch.float32, 32, with_prefix=False)
    q, k, v, lengths, table = pp.slot.q, pp.paged.k_cache, pp.paged.v_cache, pp.slot.lengths, pp.paged.block_tables
    cases = [
        (table.long(), "int32"),
        (table[:, :2], "contiguous"),
        (table[0], "2-D"),
        (table[:4], "block table has 4 rows"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            decode_attention(q, k, v, lengths, block_tables=bad, backend="triton")
    with pytest.raises(ValueError, match="paged"):
        decode_attention(q, k, v[:, :, :16], lengths, block_tables=table, backend="triton")


def test_default_config_by_the_cache_length_alone() -> None:
    """At least 512 keys per split and at most 8 splits per row: longer caches get longer (power-of-two) splits."""
    assert [default_attention_config(L).split_len for L in (1, 512, 4096, 4097, 5000, 8192, 20000)] == [
        512, 512, 512, 1024, 1024, 1024, 4096]
    assert default_attention_config(100) == AttentionConfig()


def test_workspace_sizes_and_split_checks() -> None:
    """A workspace holds two slots per split (own keys and prefix) of ``d + 1`` floats for every row and head, and
    the group tables; sizes must be positive; a split must be whole key blocks of at least 16."""
    ws = DecodeWorkspace(max_rows=2, num_heads=4, max_len=1100, head_dim=16, device="cpu")
    assert ws.buffer.numel() == 2 * 4 * 2 * 3 * (16 + 1) and ws.buffer.dtype == torch.float32  # 3 splits of 512
    assert ws.groups.numel() == 2 * (2 + PREFIX_GROUP_ROWS) and ws.groups.dtype == torch.int32
    with pytest.raises(ValueError, match="must be positive"):
        DecodeWorkspace(max_rows=0, num_heads=4, max_len=8, head_dim=16, device="cpu")
    p = make_attention_problem(2, 4, 2, 64, 16, torch.float32)
    for config in (AttentionConfig(split_len=48, block_n=32), AttentionConfig(split_len=64, block_n=8)):
        with pytest.raises(ValueError, match="must be a multiple of block_n"):
            decode_attention_triton(p.q, p.k_cache, p.v_cache, p.lengths, config=config)
