"""The page-locked host pool (:mod:`skyrl_clora.device.pinned_memory`) on the CPU, with a recording stand-in for
``cudaHostRegister``: blocks of the size asked for, locked once, handed out again only when no tensor views them."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.device import pinned_memory
from skyrl_clora.device.pinned_memory import PAGE_BYTES, PinnedPool, host_copies


@pytest.fixture
def locked() -> list[tuple[int, int]]:
    return []


@pytest.fixture
def pool(locked: list[tuple[int, int]]) -> PinnedPool:
    return PinnedPool(lock=lambda address, size: locked.append((address, size)), unlock=lambda address: None)


def test_a_block_is_the_pages_asked_for_locked_once(pool: PinnedPool, locked: list[tuple[int, int]]) -> None:
    numel = 3 * PAGE_BYTES // 4 + 5  # 3 pages and 20 bytes of fp32: a power-of-two allocator would hold 4 pages
    tensor = pool.empty(numel, torch.float32)
    assert (tensor.shape, tensor.dtype) == ((numel,), torch.float32)
    assert locked == [(tensor.data_ptr(), 4 * PAGE_BYTES)] and pool.held_bytes() == 4 * PAGE_BYTES
    big = pool.empty(5 * PAGE_BYTES // 2, torch.bfloat16)  # exactly 5 pages
    assert locked[1] == (big.data_ptr(), 5 * PAGE_BYTES) and pool.held_bytes() == 9 * PAGE_BYTES


def test_a_block_returns_to_the_pool_only_when_no_tensor_views_it(pool: PinnedPool,
                                                                   locked: list[tuple[int, int]]) -> None:
    tensor = pool.empty(1000, torch.float32)
    address = tensor.data_ptr()
    tensor.copy_(torch.arange(1000, dtype=torch.float32))
    view = tensor[10:20].view(2, 5)
    del tensor
    other = pool.empty(1000, torch.float32)
    assert other.data_ptr() != address, "a block still viewed was handed out again"
    assert view.flatten().tolist() == list(range(10, 20))
    del view
    again = pool.empty(1000, torch.float32)
    assert again.data_ptr() == address and len(locked) == 2, "a free block must be reused, not mapped anew"
    assert pool.empty(2000, torch.float32).data_ptr() not in (address, other.data_ptr()), "sizes have their own lists"


def test_a_collected_pool_unlocks_every_block_once_no_tensor_views_it() -> None:
    locked, unlocked = [], []
    pool = PinnedPool(lock=lambda address, size: locked.append(address), unlock=unlocked.append)
    kept = pool.empty(10, torch.float32)[2:4]
    pool.empty(3 * PAGE_BYTES, torch.uint8)
    del pool
    assert unlocked == [] and kept.tolist() == kept.tolist(), "a tensor from the pool keeps it and its blocks"
    del kept
    assert sorted(unlocked) == sorted(locked) and len(locked) == 2


def test_host_copies_fill_one_pool_block(monkeypatch: pytest.MonkeyPatch, pool: PinnedPool,
                                         locked: list[tuple[int, int]]) -> None:
    monkeypatch.setattr(pinned_memory, "_process_pool", lambda: pool)
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(16, 2048, generator=generator).to(torch.bfloat16), torch.randn(6144, 16, generator=generator),
               torch.randn(3, generator=generator).to(torch.bfloat16)]
    copies = host_copies(sources, pin=True)
    assert len(locked) == 1, "all copies share one block"
    start = locked[0][0]
    for source, copy in zip(sources, copies):
        assert copy.dtype == source.dtype and torch.equal(copy, source)
        assert copy.data_ptr() != source.data_ptr() and (copy.data_ptr() - start) % 64 == 0
        assert start <= copy.data_ptr() < start + locked[0][1]
    unpinned = host_copies(sources, pin=False)
    assert len(locked) == 1 and all(torch.equal(a, b) for a, b in zip(unpinned, sources))
