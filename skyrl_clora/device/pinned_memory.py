"""Page-locked host tensors of the size asked for, recycled without a device synchronization.

``torch.empty(..., pin_memory=True)`` (PyTorch's caching host allocator) rounds every allocation up to the next
power of two (``CachingHostAllocator::allocate``): one tenant's 70 MB fp32 table holds 128 MB of page-locked memory,
and hundreds of tenants' trainer state nearly twice what :meth:`AdapterStore.host_bytes` counts. A
:class:`PinnedPool` maps anonymous memory of the size asked for (whole pages), page-locks it once
(``cudaHostRegister``) and keeps it: when the last tensor viewing a block is freed, the block returns to the pool's
free list for its size and is handed out again, never unregistered (unregistering, like ``cudaFreeHost``, may
synchronize the device). Memory never returns to the system before the process ends, as with PyTorch's allocator.

Tensors from a pool are ``is_pinned()`` and copy asynchronously in stream order, but unlike the caching allocator's
they carry no record of the device work that reads or writes them: whoever queues an asynchronous copy with one
keeps it alive until the copy is done (:class:`InFlight`), so that its block is not handed out again meanwhile.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections import deque
from typing import Callable

import torch

PAGE_BYTES = mmap.PAGESIZE


def cuda_host_register(address: int, size: int) -> None:
    """Page-locks ``size`` bytes at ``address`` for the CUDA device (``cudaHostRegister``, default flags)."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, size, 0))


def cuda_host_unregister(address: int) -> None:
    """Undoes :func:`cuda_host_register` (``cudaHostUnregister``); its status is not checked, as this runs when a
    pool is collected, possibly at interpreter exit after CUDA has shut down."""
    torch.cuda.cudart().cudaHostUnregister(address)


@functools.lru_cache(maxsize=None)
def _lease_type(size: int) -> type:
    """A ``ctypes`` byte array of ``size`` whose instances, built over a pool block, give it back when collected."""
    def give_back(lease: ctypes.Array) -> None:
        lease.pool._give_back(size, ctypes.addressof(lease))

    return type(f"PinnedLease{size}", (ctypes.c_ubyte * size,), {"__del__": give_back})


class PinnedPool:
    """Page-locked host blocks by exact size (whole pages), each locked once by ``lock(address, size)`` when first
    mapped and unlocked by ``unlock(address)`` when the pool is collected (every tensor from it is gone by then: each
    holds the pool), before the block is unmapped: a stale registration would make CUDA treat whatever is mapped there
    next as page-locked. Any thread (list operations are atomic under the GIL; no lock is held while a block is given
    back, which happens wherever the last tensor viewing it is freed)."""

    def __init__(self, lock: Callable[[int, int], None] = cuda_host_register,
                 unlock: Callable[[int], None] = cuda_host_unregister) -> None:
        self._lock, self._unlock = lock, unlock
        self._free: dict[int, list[int]] = {}  # block size -> free block addresses
        self._mappings: list[tuple[int, mmap.mmap]] = []  # (address, mapping) of every block ever mapped

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D ``dtype`` tensor of ``numel`` values in a page-locked block of its own. The block
        (recycled: it may hold another tensor's old values) is the pool's again once no tensor views it."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)
        free = self._free.setdefault(size, [])
        try:
            address = free.pop()
        except IndexError:
            address = self._map(size)
        lease = _lease_type(size).from_address(address)
        lease.pool = self
        return torch.frombuffer(lease, dtype=torch.uint8)[:nbytes].view(dtype)

    def held_bytes(self) -> int:
        """Bytes of every block mapped so far, handed out or free."""
        return sum(len(mapping) for _, mapping in self._mappings)

    def _map(self, size: int) -> int:
        mapping = mmap.mmap(-1, size)
        address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        self._lock(address, size)
        self._mappings.append((address, mapping))
        return address

    def __del__(self) -> None:
        for address, _ in self._mappings:
            self._unlock(address)

    def _give_back(self, size: int, address: int) -> None:
        self._free[size].append(address)


@functools.lru_cache(maxsize=1)
def _process_pool() -> PinnedPool:
    return PinnedPool()


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised 1-D host tensor: with ``pin`` page-locked at its exact size (:meth:`PinnedPool.empty` from the
    process's pool; CUDA only), else pageable."""
    return _process_pool().empty(numel, dtype) if pin else torch.empty(numel, dtype=dtype)


def host_like(tensors: list[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """Uninitialised host tensors of ``tensors``' shapes and dtypes, all in one block (each starting at a multiple of
    64 bytes): page-locked from the process's pool with ``pin``, else pageable."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // 64) * 64
    block = host_empty(total, torch.uint8, pin)
    return [block[offset : offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            for offset, tensor in zip(offsets, tensors)]


def host_copies(tensors: list[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """Copies of ``tensors`` in one host block (:func:`host_like`)."""
    return [copy.copy_(tensor) for copy, tensor in zip(host_like(tensors, pin), tensors)]


class InFlight:
    """Host objects kept alive until the device work queued on the current stream when they were held is done
    (a CUDA event per hold), then dropped at a later :meth:`hold`. One user thread."""

    def __init__(self) -> None:
        self._held: deque[tuple[torch.cuda.Event, object]] = deque()

    def hold(self, item: object) -> None:
        """Keeps ``item`` alive past the work queued so far on the current stream (after queuing its copies)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()
        event = torch.cuda.Event()
        event.record()
        self._held.append((event, item))
