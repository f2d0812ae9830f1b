"""The sampling engine's scheduling: which waiting request takes which free cache row and which KV blocks, when,
which running request is preempted when the pool runs out, and when a queued adapter publish or unregister may
land.

Plain host bookkeeping over the row table and the KV block pool (:class:`BlockManager`), driven by the engine
thread alone (the engine keeps the thread's work, the model and every tensor). The scheduler is the only writer
of the pool's state: it hands the engine a :class:`PrefillPlan` (rows, blocks and the block copies to make
before the pass), grows the running rows' blocks before each decode step (:meth:`Scheduler.make_room`,
preempting when short), keys the prompts the engine has prefilled and frees the rows it retires. It reads the
adapters' published versions and decides which adapters hold the device slots (:class:`AdapterSlots`); the engine
writes them.

Prefill batching: while rows decode, waiting requests are admitted only once ``max_prefills_per_step`` of
them wait or the oldest has waited ``prefill_wait_steps`` decode steps, so that a prefill pass (whose cost on a GPU
hardly grows with its tokens) serves several requests; with no row running they are admitted at once.

Admission by free blocks: a request is admitted only while the pool keeps :attr:`Scheduler.watermark` blocks
available after it; with ``reserve_kv`` (the default) a request counts every block it will hold once it has sampled
its ``max_tokens`` (:meth:`Scheduler.blocks_to_finish`), and the running requests' blocks still to come are
reserved, so the pool is never over-committed; without it only its prompt's blocks count and the running rows grow
into what is left (vLLM's way). The first request that does not fit stops the round (first come, first served), and
a request whose prompt could not fit the whole pool fails alone; a request admitted alone (nothing else running)
needs only its prompt's blocks.

Preemption, the last resort (without ``reserve_kv``, or for a request admitted alone): when a running row needs a
block for its next decode step and the pool has none (after evicting unreferenced prefix blocks and histories), the
most recently admitted running request is preempted: its blocks go back to the pool and it waits first in the
queue, to start over; a request that cannot fit even alone fails with a MemoryError.

The version fence: a request is sampled entirely with the adapter version it was admitted under, so a
publish (or unregister) of an adapter lands only once none of its requests holds a row; new requests of an
adapter with a pending publish wait until it has landed, so a publish cannot starve.

Adapter slots (:class:`AdapterSlots`, a cache of device slots over the adapters' host copies): a request is admitted
only once its adapter holds a slot. One that does not takes a free slot, else the slot of the least recently used
adapter with no request running or admitted in the round (evicted), and the plan names it for the engine to load
before the pass (:attr:`PrefillPlan.loads`). When every slot's adapter is busy the request waits, and the least
recently used busy adapter is drained for it: requests of that adapter queued behind it are not admitted until it
has its slot, so a waiting adapter gets one within the running requests' lengths (one drained adapter per waiting
adapter, in the order requests are considered). Both choices take an adapter with no request waiting in the queue
before one with some (least recently used first within each), so a slot goes to a waiting adapter at the cost of
another load only when every candidate has requests waiting: which adapter loses its slot never changes what a
request samples, only how often host copies are loaded.

The queue: requests that resume wait ahead of fresh ones, each part in arrival order. A request resumes when its
prompt extends a history kept in the pool when it is queued (the next turn of an episode under way, with
``reuse_decode_kv``), or when it was preempted: episodes under way finish before new ones start, so their histories
are adopted instead of evicted while the request waits behind a long queue and its prompt computed again. Fair
admission orders the resuming requests first and then the fresh ones: it decides which episodes start, and an
episode started goes on ahead of every tenant's new ones.

Admission order (``admission``): ``"fifo"`` considers the waiting requests in queue order over all tenants;
``"fair"`` tenant by tenant, the tenant that received the least service first (virtual-token counters,
:mod:`~skyrl_clora.sampler.fair_share`), each tenant's requests in queue order; a tenant whose adapter holds a slot
counts ``slot_credit`` less while no slot is free, and a waiting adapter drains only a busy adapter whose tenant is
more than that credit ahead of its own (so a slot changes hands after a tenure, not after every request). Either way
the rules above (free rows, the prefill cap, blocks, the fence, slots) apply to each request considered.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.block_manager import BlockManager
from skyrl_clora.sampler.fair_share import ADMISSIONS, ServiceCounters, fair_order
from skyrl_clora.sampler.requests import PrefillPlan, Publish, QueuedRequest, Unregister
from skyrl_clora.sampler.slot_round import SlotRound

# Decode steps a finished turn's kept K/V is safe from fresh requests: its episode's next turn (an environment step
# away) takes it; past that a fresh request may have its blocks (a resuming request, or one alone, at any time).
HISTORY_GRACE_STEPS = 64


def _unregistered(adapter: str) -> ValueError:
    """The error a request of ``adapter`` fails with when the adapter was unregistered before it ran."""
    return ValueError(f"adapter {adapter!r} was unregistered")


class Scheduler:
    """The waiting requests (in queue order: module docstring), the pending publishes and unregisters (in arrival
    order) and the row table: ``rows[r]`` is the request running in cache row ``r`` (between :meth:`place` and :meth:`release`
    or :meth:`finish`) or None, and the KV block pool ``blocks``, whose state only this scheduler changes.

    ``reuse_decode_kv``: admission takes a stored history the prompt extends from the block pool (the request's
    row then starts with its blocks instead of computing those positions). ``prefill_wait_steps``: the most
    decode steps a request waits for others to share its prefill pass while rows decode (0: none).
    ``admission``: ``"fifo"`` or ``"fair"`` (module docstring; ``service`` holds the fair order's counters, None
    under fifo); ``reserve_kv``: admission reserves the blocks a request needs to finish (module docstring);
    ``slot_credit``: under fair admission, the counter units a tenant whose adapter holds a device slot is served
    ahead of one whose adapter would need a slot (:func:`~skyrl_clora.sampler.fair_share.tenure_key`). Raises
    ValueError for another ``admission``."""

    def __init__(self, num_rows: int, adapters: AdapterSlots, blocks: BlockManager, max_prefills_per_step: int,
                 reuse_decode_kv: bool, prefill_wait_steps: int = 0, admission: str = "fifo",
                 slot_credit: float = 0.0, reserve_kv: bool = True) -> None:
        if admission not in ADMISSIONS:
            raise ValueError(f"admission={admission!r} is unknown; use one of {', '.join(ADMISSIONS)}")
        self.adapters = adapters
        self.blocks = blocks
        # Blocks kept available after an admission: 1% of the pool (as vLLM keeps), at least one.
        self.watermark = max(1, blocks.num_blocks // 100)
        self.max_prefills_per_step = max_prefills_per_step
        self.reuse_decode_kv = reuse_decode_kv
        self.prefill_wait_steps = prefill_wait_steps
        self.decode_steps = 0  # decode steps launched so far (the engine counts them with :meth:`decode_launched`)
        self.rows: list[QueuedRequest | None] = [None] * num_rows
        self._admitted_at = np.zeros(num_rows, dtype=np.int64)  # per row: when its request was placed (1, 2, ...)
        self.reserve_kv = reserve_kv
        self._final_blocks = np.zeros(num_rows, dtype=np.int64)  # per row: its request's blocks_to_finish (0: free)
        self._admissions = 0
        self._waiting: list[QueuedRequest] = []  # those that resume first (``resumes``), then the others
        self._resuming = 0  # how many requests at the front of ``_waiting`` resume
        self._pending: list[Publish | Unregister] = []
        self.service = ServiceCounters() if admission == "fair" else None
        self.slot_credit = slot_credit

    def enqueue(self, item: QueuedRequest | Publish | Unregister) -> None:
        """Queues a request to be admitted, or a publish or unregister to be applied. A request whose prompt needs more
        KV blocks than the pool has fails at once (MemoryError naming the fixes)."""
        if isinstance(item, QueuedRequest):
            needed = -(-(len(item.prompt_ids) + 1) // self.blocks.block_size)
            if needed > self.blocks.num_blocks:
                item.future.set_exception(MemoryError(
                    f"a prompt of {len(item.prompt_ids)} tokens needs {needed} KV blocks of {self.blocks.block_size} "
                    f"tokens; the engine's pool has {self.blocks.num_blocks}: raise sampler.gpu_memory_utilization (or "
                    "sampler.kv_blocks) or shorten the prompt"))
                return
            item.queued_at = self.decode_steps
            item.resumes = self._extends_history(item)
            if item.resumes:
                self._waiting.insert(self._resuming, item)
                self._resuming += 1
            else:
                self._waiting.append(item)
        else:
            self._pending.append(item)

    def requeue(self, request: QueuedRequest) -> None:
        """Puts ``request`` (preempted, or short of blocks at its prefill: its row and blocks were released) first
        in the queue, resuming, to start over (its output so far dropped)."""
        request.row, request.history = -1, None
        request.output, request.logprobs = [], []
        request.resumes = True
        self._waiting.insert(0, request)
        self._resuming += 1

    def _extends_history(self, request: QueuedRequest) -> bool:
        """Whether ``request``'s prompt extends a history kept in the pool (the next turn of an episode under way,
        with ``reuse_decode_kv``)."""
        if not self.reuse_decode_kv or (request.adapter is not None and request.adapter not in self.adapters):
            return False
        try:
            version = -1 if request.adapter is None else self.adapters.version(request.adapter)
        except KeyError:  # registered, its first version not published yet
            return False
        return self.blocks.has_history(request.adapter, version, request.prompt_ids)

    def decode_launched(self) -> None:
        """Counts a decode step launched (the clock of ``prefill_wait_steps``) for the requests running now (charged
        to their tenants under fair admission)."""
        self.decode_steps += 1
        if self.service is not None:
            self.service.decoded()

    def idle(self) -> bool:
        """Whether nothing waits, nothing is pending and no row runs."""
        return not self._waiting and not self._pending and not any(self.rows)

    def running(self) -> list[QueuedRequest]:
        """The requests holding a row, in row order."""
        return [req for req in self.rows if req is not None]

    def place(self, request: QueuedRequest) -> None:
        """``request`` now runs in its row ``request.row`` (set by :meth:`admit`), which must be free, until :meth:`release`."""
        self.rows[request.row] = request
        self._final_blocks[request.row] = self.blocks_to_finish(request)
        if self.service is not None:
            self.service.started(request.adapter)
        self._admissions += 1
        self._admitted_at[request.row] = self._admissions

    def release(self, row: int) -> None:
        """Frees cache row ``row`` and gives its blocks back to the pool."""
        self.blocks.release(row)
        if self.service is not None and self.rows[row] is not None:
            self.service.stopped(self.rows[row].adapter)
        self.rows[row] = None
        self._final_blocks[row] = 0

    def blocks_to_finish(self, request: QueuedRequest) -> int:
        """The blocks ``request``'s row holds once it has sampled its ``max_tokens`` (or filled the row): every
        position up to ``prompt + max_tokens - 1`` (the decode step that may run past its last token included)."""
        block = self.blocks.block_size
        return -(-min(len(request.prompt_ids) + request.params.max_tokens, self.blocks.max_blocks_per_row * block)
                 // block)

    def reserved_blocks(self) -> int:
        """With ``reserve_kv``, the blocks the running requests will still take from the pool to finish (their
        :meth:`blocks_to_finish` less what their rows hold); else 0."""
        if not self.reserve_kv:
            return 0
        return int(np.maximum(self._final_blocks - self.blocks.row_counts, 0).sum())

    def finish(self, request: QueuedRequest) -> None:
        """``request`` (running, its ``output`` set) finished: with ``reuse_decode_kv`` its row's blocks holding its
        prompt and every sampled token but the last (whose K/V no step computed) stay as a history; its row is
        freed."""
        if self.reuse_decode_kv:
            self.blocks.keep_history(request.row, request.adapter, request.version,
                                     request.prompt_ids + request.output[:-1], self.decode_steps)
        self.release(request.row)

    def changed_tables(self) -> np.ndarray | None:
        """The block tables (``BlockManager.tables``) if they changed since the last call, else None: the engine
        copies them to the device before its next pass."""
        if not self.blocks.dirty:
            return None
        self.blocks.dirty = False
        return self.blocks.tables

    def ready_publishes(self) -> list[Publish | Unregister]:
        """Removes and returns (in arrival order) the pending publishes and unregisters whose adapter has no
        running row, their adapters' cached prefixes and histories dropped from the pool (and an unregistered
        adapter's fair counter): the caller applies them now, before admitting; the others stay pending and keep
        their adapter's waiting requests fenced."""
        if not self._pending:
            return []
        busy = {req.adapter for req in self.rows if req is not None}
        ready = [item for item in self._pending if item.adapter not in busy]
        self._pending = [item for item in self._pending if item.adapter in busy]
        for item in ready:
            self.blocks.drop_adapter(item.adapter)
            if isinstance(item, Unregister) and self.service is not None:
                self.service.forget(item.adapter)
        return ready

    def _gathering(self) -> bool:
        """Whether the waiting requests should wait for more to share their prefill pass: rows are running,
        fewer than ``max_prefills_per_step`` wait and none has waited ``prefill_wait_steps`` decode steps."""
        if not self.prefill_wait_steps or len(self._waiting) >= self.max_prefills_per_step or not any(self.rows):
            return False
        oldest = min(req.queued_at for req in self._waiting)
        return self.decode_steps - oldest < self.prefill_wait_steps

    def unregister(self, adapter: str) -> None:
        """Applies an unregister :meth:`ready_publishes` let land: ``adapter``'s slot is emptied and freed and its host
        copy dropped (:meth:`AdapterSlots.clear`), and every waiting request of it fails and leaves the queue."""
        self.adapters.clear(adapter)
        for req in [r for r in self._waiting if r.adapter == adapter]:
            self._waiting.remove(req)
            self._resuming -= req.resumes
            req.future.set_exception(_unregistered(adapter))

    def unload(self, adapters: list[str]) -> None:
        """Gives back the device slots of ``adapters``, loaded for a prefill that failed (a later round gives them
        slots and loads them again when their requests come)."""
        for name in adapters:
            if self.adapters.resident(name):
                self.adapters.evict(name)

    def admit(self) -> PrefillPlan:
        """Admits waiting requests (in the ``admission`` order: module docstring) into the free rows, lowest first, at most
        ``max_prefills_per_step`` of them and while the block pool keeps :attr:`watermark` blocks available
        after each (dropping stored histories, oldest first, to make room): sets each one's ``row``,
        ``version``, ``history`` and ``lora_slot`` (giving its adapter a slot when it holds none) and returns a plan
        of them in admission order with the adapters to load (:meth:`schedule_prefill` then gives them their
        blocks; they run once :meth:`prefilled`). Of the requests it considers, cancelled ones are dropped and those
        whose adapter is no longer registered fail; requests of an adapter with a pending publish or unregister wait
        (the version fence), and so do requests whose adapter cannot have a device slot in this round or is drained
        for another (:class:`~skyrl_clora.sampler.slot_round.SlotRound`): once one of an adapter's requests waits
        for either reason, the round considers no more of that adapter's. The round ends at the first request that
        finds no free row, no prefill place or too few blocks; the requests after it are considered in a later round.
        With hundreds of tenants on a few slots thousands of requests wait; a held adapter's later requests then cost
        the round a set lookup each, the slot decisions one look per adapter.

        A request whose first uncached prompt block is also the first uncached block of another request
        admitted in this round waits one round, so that it finds that prefix (a GRPO group's prompt, a
        tenant's system prompt) keyed instead of computing it again; requests that share only keyed blocks
        (the turns of a GRPO group's episodes) are admitted together. While rows run, nothing is admitted until
        ``max_prefills_per_step`` requests wait or the oldest has waited ``prefill_wait_steps`` decode steps."""
        plan = PrefillPlan()
        if not self._waiting or self._gathering():
            return plan
        fenced = {item.adapter for item in self._pending}
        free_rows = [row for row, req in enumerate(self.rows) if req is None]
        admitted = plan.requests
        first_missing: set[tuple] = set()
        gone: set[int] = set()  # ids of the requests admitted, dropped or failed in this round
        held: set[str | None] = set()  # adapters whose requests all wait this round (fenced or without a slot)
        reserved = self.reserved_blocks()
        budget = self.blocks.available() - reserved
        spent = 0  # blocks the requests admitted this round will take (to finish, with reserve_kv)
        slots = SlotRound(self.adapters, self.rows, self._waiting, plan, self.service, self.slot_credit)
        order: Iterable[QueuedRequest] = self._waiting
        if self.service is not None:
            running = {req.adapter for req in self.rows if req is not None}
            self.service.observe({req.adapter for req in self._waiting} | running)
            # The credit counts only while every slot holds an adapter (a tenant without one then needs another's).
            resident = frozenset() if self.adapters.free() else frozenset(self.adapters.lru())
            order = itertools.chain(*(fair_order(part, self.service, resident, self.slot_credit, held) for part in
                                      (self._waiting[: self._resuming], self._waiting[self._resuming :])))
        for req in order:
            if not free_rows or len(admitted) >= self.max_prefills_per_step:
                break
            if req.adapter in held:
                continue
            if req.future.cancelled():
                gone.add(id(req))
                continue
            if req.adapter is not None and req.adapter not in self.adapters:  # unregistered after it was submitted
                req.future.set_exception(_unregistered(req.adapter))
                gone.add(id(req))
                continue
            if req.adapter in fenced or slots.holds_back(req.adapter):
                held.add(req.adapter)
                continue
            version = -1 if req.adapter is None else self.adapters.version(req.adapter)
            history = self.blocks.take_history(req.adapter, version, req.prompt_ids) if self.reuse_decode_kv else None
            keyed, missing = ([], None) if history else self.blocks.keyed_prefix(req.adapter, version, req.prompt_ids)
            shared_key = None if missing is None else (req.adapter, missing)
            if shared_key in first_missing:
                continue
            cost = self.blocks.admission_cost(len(req.prompt_ids), keyed, 0 if history is None else len(history[1]))
            need = cost  # with reserve_kv, and the blocks its decode steps will add
            if self.reserve_kv:
                need += self.blocks_to_finish(req) - -(-len(req.prompt_ids) // self.blocks.block_size)
            alone = not admitted and not any(self.rows)  # nothing else could free blocks: its prompt must fit
            if budget - need < self.watermark:  # dropping kept turns may make room (a fresh request: only old ones)
                kept_before = None if req.resumes or alone else self.decode_steps - HISTORY_GRACE_STEPS
                self.blocks.reclaim((cost if alone else need + self.watermark) + spent + reserved, kept_before)
                budget = self.blocks.available() - spent - reserved
            if budget - (cost if alone else need) < (0 if alone else self.watermark):  # the pool takes no more
                if history is not None:  # not admitted now: the history goes back to the pool
                    self.blocks.store_history(req.adapter, version, req.prompt_ids[: history[0]], history[1],
                                              self.decode_steps)
                break
            if shared_key is not None:
                first_missing.add(shared_key)
            budget -= need
            spent += need
            req.version, req.history = version, history
            req.row = free_rows.pop(0)
            admitted.append(req)
            gone.add(id(req))
            slots.admitted(req)
            if self.service is not None:
                self.service.admitted(req)
        if gone:
            self._waiting = [req for req in self._waiting if id(req) not in gone]  # in the order kept
            self._resuming = sum(req.resumes for req in self._waiting[: self._resuming])
        return plan

    def schedule_prefill(self) -> PrefillPlan:
        """This round's prefill: the requests :meth:`admit` admits (with their adapters' slots and loads), each given
        the blocks of its prompt (:meth:`_take_blocks`), in admission order. A request the pool cannot give its
        blocks now (they were counted, but the copy of a shared block or eviction order may need one more) gives
        them back and waits first in the queue (those requests in their order; their adapters keep the slots they
        were given, and are loaded all the same)."""
        admitted = self.admit()
        plan = replace(admitted, requests=[])
        short = []
        for req in admitted.requests:
            try:
                plan.starts.append(self._take_blocks(req, plan.copies))
                plan.requests.append(req)
            except MemoryError:
                self.blocks.release(req.row)
                short.append(req)
        for req in reversed(short):
            self.requeue(req)
        return plan

    def _take_blocks(self, req: QueuedRequest, copies: tuple[list[int], list[int]]) -> int:
        """Gives ``req``'s row the blocks of its prompt: its history's, or the keyed ones of its leading whole
        blocks, then a copy of the block it writes into first if that one is shared (appended to ``copies`` as
        source and target), then new blocks for the rest. Returns the first position the prefill computes (the
        last prompt token always: its logits are needed). Raises MemoryError when the pool is short."""
        block = self.blocks.block_size
        if req.history is not None:
            length, held = req.history
            self.blocks.adopt(req.row, held, owned=True)
            start = min(length, len(req.prompt_ids) - 1)
        else:
            cached = self.blocks.lookup(req.adapter, req.version, req.prompt_ids)
            self.blocks.adopt(req.row, cached, owned=False)
            start = min(len(cached) * block, len(req.prompt_ids) - 1)
        if start < self.blocks.row_counts[req.row] * block:
            copy = self.blocks.make_writable(req.row, start // block)
            if copy is not None:
                copies[0].append(copy[0])
                copies[1].append(copy[1])
        if not self.blocks.grow(req.row, -(-len(req.prompt_ids) // block)):
            raise MemoryError(f"no KV block is free for a prompt of {len(req.prompt_ids)} tokens")
        return start

    def prefilled(self, req: QueuedRequest, start: int) -> None:
        """The engine computed ``req``'s prompt from position ``start`` on: its whole blocks from there are keyed
        for later prompts (unless it started from a history, whose positions decode steps partly computed), and
        it runs in its row (:meth:`place`)."""
        if req.history is None:
            self.blocks.key_prompt(req.row, req.adapter, req.version, req.prompt_ids, start // self.blocks.block_size)
        req.history = None
        self.place(req)

    def make_room(self, rows: np.ndarray, needed: np.ndarray) -> tuple[list[int], list[int]]:
        """Gives each running row ``rows[i]`` at least ``needed[i]`` blocks (what its next decode step writes into),
        preempting the most recently placed running request (:meth:`requeue`) while the pool has none; a request
        that is alone and still short fails with a MemoryError and its row is freed. Returns the rows preempted
        and the rows failed, for the engine to stop."""
        preempted: list[int] = []
        failed: list[int] = []
        short = needed > self.blocks.row_counts[rows]
        for row, count in zip(rows[short].tolist(), needed[short].tolist()):
            while self.rows[row] is not None and not self.blocks.grow(row, count):
                running = np.array([r for r, req in enumerate(self.rows) if req is not None], dtype=np.int64)
                victim = int(running[np.argmax(self._admitted_at[running])])
                req = self.rows[row] if running.size == 1 else self.rows[victim]
                self.release(req.row)
                if running.size == 1:
                    failed.append(row)
                    req.future.set_exception(MemoryError(
                        f"a request of {len(req.prompt_ids)} prompt tokens needs more than the {self.blocks.num_blocks} "
                        f"KV blocks of {self.blocks.block_size} tokens the pool holds: raise "
                        "sampler.gpu_memory_utilization (or sampler.kv_blocks) or lower its max_tokens"))
                else:
                    preempted.append(victim)
                    self.requeue(req)
        return preempted, failed
