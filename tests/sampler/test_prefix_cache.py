"""The prefix cache's history entries: longest-prefix match, one use each, shared byte budget, per-adapter drop;
the prefix identities that tell which cache rows hold the same cached K/V."""

from __future__ import annotations

import torch

from skyrl_clora.sampler.prefix_cache import PrefixCache


def _kv(length: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of ``length`` positions (2 layers, 1 KV head, head dim 4): 32 bytes per position each."""
    return torch.full((2, 1, length, 4), fill), torch.full((2, 1, length, 4), -fill)


def test_take_history_returns_the_longest_stored_prefix_once() -> None:
    cache = PrefixCache(block_size=16, budget_bytes=1 << 20)
    turn1 = list(range(100, 130))
    turn2 = turn1 + list(range(200, 215))
    cache.insert_history("a", 0, turn1, _kv(len(turn1), 1.0))
    cache.insert_history("a", 0, turn2, _kv(len(turn2), 2.0))
    cache.insert_history("a", 0, [7] * 10, _kv(10, 3.0))  # not a prefix of the request below
    request = turn2 + [5, 6, 7]
    assert cache.take_history("b", 0, request) is None, "another adapter's histories never match"
    assert cache.take_history("a", 1, request) is None, "another version's histories never match"
    length, (k, v), _ = cache.take_history("a", 0, request)
    assert length == len(turn2) and k.shape[2] == len(turn2) and float(k[0, 0, 0, 0]) == 2.0
    length, (k, _), _ = cache.take_history("a", 0, request)
    assert length == len(turn1) and float(k[0, 0, 0, 0]) == 1.0, "each history serves one request"
    assert cache.take_history("a", 0, request) is None
    changed = turn1[:-1] + [999] + list(range(200, 215))
    cache.insert_history("a", 0, turn1, _kv(len(turn1), 1.0))
    assert cache.take_history("a", 0, changed) is None, "a history matches only if every token does"
    assert cache.take_history("a", 0, turn1) is not None, "a prompt equal to a history matches it"
    cache.take_history("a", 0, [7] * 11)
    assert cache.used_bytes == 0 and not cache._history_lengths and not cache._history_index, "nothing left behind"


def test_histories_and_blocks_share_one_budget_and_lru_order() -> None:
    per_position = 2 * 2 * 1 * 4 * 4  # k and v, 2 layers, 1 head, dim 4, fp32
    cache = PrefixCache(block_size=16, budget_bytes=100 * per_position)
    old, new = list(range(60)), list(range(1000, 1060))
    cache.insert_history("a", 0, old, _kv(60, 1.0))
    cache.insert("a", 0, list(range(500, 532)), 0, lambda index: _kv(16, 4.0))  # two blocks: 92 positions held
    assert cache.used_bytes == 92 * per_position
    cache.insert_history("a", 0, new, _kv(60, 2.0))  # over budget: the oldest entry (the first history) goes
    assert cache.take_history("a", 0, old + [1]) is None
    assert cache.used_bytes == 92 * per_position
    assert len(cache.lookup("a", 0, list(range(500, 533)))[0]) == 2
    cache.drop_adapter("a")
    assert cache.used_bytes == 0 and cache.take_history("a", 0, new + [1]) is None


def test_identities_name_the_block_chain_a_row_holds() -> None:
    """A row that stored blocks gets the chain key of its last stored block; a row that looked the same
    prompt up gets the same key; a history hands its row's identity on; a block stored earlier by another
    row ends the storing row's run (its bytes there are the other row's)."""
    cache = PrefixCache(block_size=16, budget_bytes=1 << 20)
    prompt = list(range(40))  # two whole blocks and 8 positions
    identity = cache.insert("a", 0, prompt, 0, lambda index: _kv(16, float(index)))
    blocks, key = cache.lookup("a", 0, prompt)
    assert len(blocks) == 2 and identity == (key, 32)
    assert cache.lookup("a", 0, list(range(1, 40))) == ([], None)
    longer = prompt[:32] + list(range(100, 132))  # shares the two blocks, adds two of its own
    assert cache.insert("a", 0, longer, 2, lambda index: _kv(16, 9.0))[1] == 64
    other = list(range(16)) + list(range(300, 332))  # block 0 is cached already: its run never opens
    assert cache.insert("a", 0, other, 0, lambda index: _kv(16, 5.0)) is None
    cache.insert_history("a", 0, prompt + [7], _kv(41, 1.0), prefix=identity)
    assert cache.take_history("a", 0, prompt + [7, 8])[2] == identity
    cache.drop_adapter("a")  # computed again after an eviction: another entry, maybe other bits
    again = cache.insert("a", 0, prompt, 0, lambda index: _kv(16, float(index)))
    assert again[1] == 32 and again[0] != identity[0]


def test_shared_rows_cut_a_chain_into_groups_read_from_their_widest_member() -> None:
    """Ten rows copy chain A (more than one attention tile of PREFIX_GROUP_ROWS rows), two copy chain B and
    one copies nothing: A's rows form a group of the first eight and one of the last two, each read from
    its member covering the most positions."""
    from skyrl_clora.kernels.attention.decode import PREFIX_GROUP_ROWS
    from skyrl_clora.sampler.shared_rows import SharedPrefixRows

    assert PREFIX_GROUP_ROWS == 8
    shared = SharedPrefixRows(16)
    a_rows = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]
    widths = [128, 256, 256, 128, 256, 128, 128, 384, 128, 256]
    for row, width in zip(a_rows, widths):
        shared.assign(row, (("block", "a", 0, b"x", 1), width))
    shared.assign(11, (("block", "b", 0, b"y", 2), 128))
    shared.assign(12, (("block", "b", 0, b"y", 2), 256))
    rows, lens = shared.sources(14)
    assert rows[:8] == [8, 8, 8, 8, 4, 8, 8, 8] and rows[9:11] == [10, 10]  # row 4 holds nothing: itself
    assert rows[11:13] == [12, 12] and rows[13] == 13
    assert lens[:4] == [128, 256, 256, 128] and lens[4] == 0 and lens[8] == 384 and lens[12] == 256
    assert shared.borrowed_positions == sum(widths) - 384 - 256 + 128
    shared.clear(8)
    rows, _ = shared.sources(14)
    assert rows[0] == rows[9] == 1 and rows[10] == 10, "rows 0-7 and 9 regroup, read from the first of the widest"
