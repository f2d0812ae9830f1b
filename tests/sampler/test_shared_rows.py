"""Which cache rows share their leading KV blocks (skyrl_clora.sampler.shared_rows): per decode batch, each position's
group source (the member covering the most positions, the lowest row among equals; groups of at most
``PREFIX_GROUP_ROWS`` rows in row order) and how many positions it reads there, nothing shared for a row outside any
group, an idle position or a source not in the batch; the groups follow rows joining and leaving. Through the engine,
rows sharing a cached prompt read one copy and sample exactly what they sample reading their own."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from skyrl_clora.kernels.attention.decode import PREFIX_GROUP_ROWS
from skyrl_clora.sampler.shared_rows import SharedPrefixRows

from tests.support.engine_threads import engine_on as _engine
from tests.support.engine_threads import seeded_params as _params


def test_rows_sharing_a_cached_prompt_read_one_copy_with_the_same_results(micro_model_dir: Path) -> None:
    """Two tenants' GRPO groups of one prompt, two turns each (histories reused): decode attention reads the
    group's copied prompt positions from one row (never across tenants, whose K/V differ), and every token
    and log-prob equals an engine where each row reads its own copy."""
    prompt = [(7 * i) % 300 + 5 for i in range(40)]  # two whole blocks and a part
    engines = [_engine(micro_model_dir, num_rows=16, adapters={"a": 1, "b": 2}, reuse_decode_kv=True,
                       share_prefix_reads=share)[0] for share in (True, False)]
    try:
        results = []
        for engine in engines:
            engine.pause()  # the requests reach the engine together
            firsts = [engine.submit(prompt, adapter, _params(seed, max_tokens=6)) for adapter in "ab" for seed in range(4)]
            engine.resume()
            firsts = [future.result(timeout=60) for future in firsts]
            engine.pause()
            seconds = [engine.submit(prompt + first.token_ids + [40, 41], adapter, _params(10 + i, max_tokens=6))
                       for i, (adapter, first) in enumerate(zip("aaaabbbb", firsts))]
            engine.resume()
            results.append([(c.token_ids, c.logprobs) for c in firsts + [future.result(timeout=60) for future in seconds]])
        assert len({tuple(tokens) for tokens, _ in results[0]}) == 16, "samples and tenants must differ"
        assert results[0] == results[1]
        assert engines[0].stats.shared_prefix_positions > 0 and engines[1].stats.shared_prefix_positions == 0
    finally:
        for engine in engines:
            engine.shutdown()


def test_each_batch_position_reads_its_groups_source_position() -> None:
    """Rows 2, 5 and 9 hold the same two keyed blocks (32 positions), row 7 a chain of its own, row 4 none; the
    batch runs rows 9, 4, 2, 7, 5 at positions 0-4 of 16: rows 5 and 9 read row 2's batch position, each row of a
    chain (its source included) reads its own 32 or 16 positions there, the other positions nothing."""
    shared = SharedPrefixRows(16)
    for row in (2, 5, 9):
        shared.assign(row, ((10, 11), 32))
    shared.assign(7, ((20,), 16))
    shared.assign(4, None)
    prefix_rows, prefix_lens = shared.sources(np.array([9, 4, 2, 7, 5]), 16)
    assert prefix_rows.tolist() == [2, 1, 2, 3, 2] + list(range(5, 16))
    assert prefix_lens.tolist() == [32, 0, 32, 16, 32] + [0] * 11
    assert prefix_rows.dtype == prefix_lens.dtype == np.int64
    assert shared.borrowed_positions == 64, "rows 5 and 9 read 32 positions each through row 2"
    assert shared.identity(5) == ((10, 11), 32) and shared.identity(4) is None


def test_a_source_outside_the_batch_shares_nothing() -> None:
    shared = SharedPrefixRows(16)
    for row in (2, 5, 9):
        shared.assign(row, ((10, 11), 32))
    prefix_rows, prefix_lens = shared.sources(np.array([9, 5]), 16)
    assert prefix_rows.tolist() == list(range(16)) and not prefix_lens.any()


def test_a_chain_is_cut_into_groups_of_prefix_group_rows_each_read_through_its_longest_member() -> None:
    """``PREFIX_GROUP_ROWS + 2`` rows of one chain: the first group's source is row 3, which covers 48 positions (the
    others 32), the second group's its lowest row; each member reads its own length."""
    count = PREFIX_GROUP_ROWS + 2
    shared = SharedPrefixRows(32)
    for row in range(count):
        shared.assign(row, ((1, 2, 3), 48 if row == 3 else 32))
    prefix_rows, prefix_lens = shared.sources(np.arange(count), 32)
    group = PREFIX_GROUP_ROWS
    assert prefix_rows.tolist() == [3] * group + [group, group] + list(range(count, 32))
    assert prefix_lens.tolist() == [48 if row == 3 else 32 for row in range(count)] + [0] * (32 - count)
    assert shared.borrowed_positions == (group - 1) * 32 + 32


def test_the_groups_follow_rows_that_join_and_leave() -> None:
    """Row 2 (the source) leaves: row 5 becomes its group's source; a row assigned no positions shares nothing."""
    shared = SharedPrefixRows(16)
    for row in (2, 5, 9):
        shared.assign(row, ((10, 11), 32))
    rows = np.array([2, 5, 9])
    assert shared.sources(rows, 16)[0][:3].tolist() == [0, 0, 0]
    shared.clear(2)
    prefix_rows, prefix_lens = shared.sources(rows, 16)
    assert prefix_rows[:3].tolist() == [0, 1, 1] and prefix_lens[:3].tolist() == [0, 32, 32]
    assert shared.borrowed_positions == 32
    shared.assign(9, ((10, 11), 0))
    assert shared.identity(9) is None
    prefix_rows, prefix_lens = shared.sources(rows, 16)
    assert prefix_rows[:3].tolist() == [0, 1, 2] and prefix_lens[:3].tolist() == [0, 32, 0]
    assert shared.borrowed_positions == 0
