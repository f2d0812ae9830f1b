"""The paged KV block pool: rows growing block by block, keyed prompt blocks shared by reference and evicted
least recently used first, histories adopted whole, copy on write of a shared block, per-adapter drops, and
every block back in the pool at the end."""

from __future__ import annotations

from skyrl_clora.sampler.block_manager import BlockManager

BS = 4


def _all_free(pool: BlockManager) -> bool:
    return pool.available() == pool.num_blocks and pool.held_blocks() == 0


def test_rows_take_blocks_as_they_grow_and_give_them_back() -> None:
    pool = BlockManager(num_blocks=6, block_size=BS, num_rows=2, max_blocks_per_row=4)
    assert (pool.tables == pool.scratch).all(), "free rows and the scratch row name the scratch block"
    assert pool.grow(0, 2) and pool.row_blocks[0] == [0, 1] and list(pool.tables[0, :2]) == [0, 1]
    assert pool.grow(1, 3) and pool.row_blocks[1] == [2, 3, 4]
    assert not pool.grow(0, 4), "one block left: the row gets it and reports the shortage"
    assert pool.row_counts[0] == 3 and pool.available() == 0
    pool.release(1)
    assert pool.available() == 3 and (pool.tables[1] == pool.scratch).all()
    pool.release(0)
    assert _all_free(pool)


def test_keyed_prompt_blocks_are_shared_then_evicted_least_recently_used_first() -> None:
    pool = BlockManager(num_blocks=4, block_size=BS, num_rows=3, max_blocks_per_row=4)
    prompt = list(range(10))  # two whole blocks and two positions
    assert pool.lookup("a", 0, prompt) == [] and pool.keyed_prefix("a", 0, prompt)[1] is not None
    pool.grow(0, 3)
    pool.key_prompt(0, "a", 0, prompt, first_block=0)
    assert pool.keyed_prefix("a", 0, prompt)[1] is None
    shared = pool.lookup("a", 0, prompt)
    assert shared == pool.row_blocks[0][:2], "the whole blocks are keyed, the partial third is not"
    assert pool.lookup("b", 0, prompt) == [] and pool.lookup("a", 1, prompt) == [], "other adapters and versions miss"
    pool.adopt(1, shared, owned=False)
    assert pool.identity(1) == (tuple(shared), 2 * BS) == pool.identity(0)
    assert list(pool.refs[shared]) == [2, 2]
    pool.release(0)
    pool.release(1)
    assert pool.available() == 4 and pool.held_blocks() == 0, "keyed blocks held by nothing are evictable"
    assert pool.lookup("a", 0, prompt) == shared, "and still found"
    other = list(range(100, 108))
    pool.grow(2, 2)  # takes the two free blocks
    pool.key_prompt(2, "a", 0, other, first_block=0)
    pool.release(2)
    pool.lookup("a", 0, other)  # now the most recently used
    pool.grow(0, 2)  # no free block: evicts the two least recently used (the first prompt's)
    assert pool.evictions == 2 and pool.lookup("a", 0, prompt) == [] and len(pool.lookup("a", 0, other)) == 2
    pool.release(0)
    pool.drop_adapter("a")
    assert _all_free(pool) and pool.lookup("a", 0, other) == []


def test_a_history_is_adopted_whole_once_and_keeps_its_shared_prefix() -> None:
    pool = BlockManager(num_blocks=8, block_size=BS, num_rows=2, max_blocks_per_row=6)
    prompt = list(range(8))
    pool.grow(0, 2)
    pool.key_prompt(0, "a", 0, prompt, first_block=0)
    pool.grow(0, 4)
    turn = prompt + [50, 51, 52, 53, 54, 55]  # the prompt and the sampled tokens but the last: 14 positions
    pool.keep_history(0, "a", 0, turn)
    assert pool.row_counts[0] == 0 and pool.held_blocks() == 4, "the history holds its 4 blocks, the row none"
    assert pool.take_history("b", 0, turn + [1]) is None and pool.take_history("a", 1, turn + [1]) is None
    assert pool.take_history("a", 0, turn[:-1]) is None, "a prompt shorter than the history does not extend it"
    length, blocks = pool.take_history("a", 0, turn + [60, 61])
    assert length == len(turn) and len(blocks) == 4
    assert pool.take_history("a", 0, turn + [60, 61]) is None, "a history serves one next turn"
    pool.adopt(1, blocks, owned=True)
    assert pool.identity(1) == (tuple(blocks[:2]), 2 * BS), "the keyed prompt blocks stay shared"
    assert pool.make_writable(1, 3) is None, "the history's partial last block is the row's own"
    source, copy = pool.make_writable(1, 1)
    assert source == blocks[1] and copy not in blocks and pool.row_blocks[1][1] == copy
    assert pool.identity(1) == (tuple(blocks[:1]), BS)
    pool.release(1)
    pool.drop_adapter("a")
    assert _all_free(pool)


def test_evictable_blocks_go_before_histories_and_reclaim_drops_histories() -> None:
    """A history (the oldest entry) and two unreferenced prompt blocks (newer): growing a row takes the free blocks,
    then the prompt blocks, least recently used first, and the history survives; only when nothing else is left
    does an allocation drop the history. reclaim drops histories to make blocks available."""
    pool = BlockManager(num_blocks=6, block_size=BS, num_rows=2, max_blocks_per_row=6)
    pool.grow(0, 2)
    pool.keep_history(0, "a", 0, list(range(6)))  # oldest: a history of 2 blocks
    pool.grow(1, 2)
    pool.key_prompt(1, "a", 0, list(range(10, 18)), first_block=0)
    pool.release(1)  # two evictable blocks, newer
    assert pool.available() == 4 and pool.held_blocks() == 2
    assert pool.grow(0, 2) and pool.available() == 2, "the free blocks go first"
    assert pool.grow(0, 3) and pool.lookup("a", 0, list(range(10, 18))) == [], "then the older prompt block"
    assert pool.grow(0, 4) and pool.available() == 0, "then the other"
    assert pool.has_history("a", 0, list(range(7))), "the history outlived the newer prompt blocks"
    assert pool.grow(1, 1) and not pool.has_history("a", 0, list(range(7))), "nothing else left: the history goes"
    pool.release(0)
    pool.release(1)
    pool.grow(0, 2)
    pool.keep_history(0, "b", 3, list(range(5)))
    assert pool.available() == 4 and pool.reclaim(6) and pool.take_history("b", 3, list(range(6))) is None


def test_reclaim_takes_only_histories_kept_before_a_step_and_none_when_they_cannot_make_room() -> None:
    """Three histories of 2 blocks kept at steps 0, 5 and 9 fill a pool of 6: kept before step 6, the first two
    may go; 4 blocks are reclaimed from them, 6 are not (so neither is dropped); without a bound all may go."""
    pool = BlockManager(num_blocks=6, block_size=BS, num_rows=1, max_blocks_per_row=4)
    for index, step in enumerate((0, 5, 9)):
        pool.grow(0, 2)
        pool.keep_history(0, "a", 0, list(range(10 * index, 10 * index + 6)), now=step)
    kept = [list(range(10 * index, 10 * index + 7)) for index in range(3)]
    assert pool.available() == 0
    assert not pool.reclaim(6, kept_before=6) and all(pool.has_history("a", 0, t) for t in kept), "nothing dropped"
    assert pool.reclaim(2, kept_before=6)
    assert [pool.has_history("a", 0, t) for t in kept] == [False, True, True]
    assert pool.reclaim(4, kept_before=6)
    assert [pool.has_history("a", 0, t) for t in kept] == [False, False, True]
    assert not pool.reclaim(6, kept_before=6) and pool.reclaim(6) and pool.available() == 6


def test_admission_cost_counts_new_blocks_and_unheld_keyed_ones() -> None:
    pool = BlockManager(num_blocks=8, block_size=BS, num_rows=2, max_blocks_per_row=6)
    prompt = list(range(10))  # 3 blocks

    def cost(tokens: list[int], reused: int = 0) -> int:
        return pool.admission_cost(len(tokens), pool.keyed_prefix("a", 0, tokens)[0], reused)

    assert cost(prompt) == 4, "3 new blocks and one to copy into"
    pool.grow(0, 3)
    pool.key_prompt(0, "a", 0, prompt, first_block=0)
    assert cost(prompt) == 2, "the keyed 2 are held by row 0: free to share"
    pool.release(0)
    assert cost(prompt) == 4, "unheld keyed blocks stop being evictable"
    assert cost(prompt + [1, 2, 3], reused=2) == 3
