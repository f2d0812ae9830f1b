"""The engine's scheduler on its own (no model): FIFO admission into free rows, the per-round prefill cap, prefill
batching while rows decode, the version fence, the one-round wait of requests sharing a first uncached prefix block,
cancelled and unregistered requests, the blocks a prefill plan gives its rows, preemption when the pool runs out,
histories kept at a finish and prefixes dropped at a publish."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
from torch import nn

from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.block_manager import BlockManager
from skyrl_clora.sampler.requests import Publish, QueuedRequest, SamplingParams, Unregister
from skyrl_clora.sampler.scheduler import HISTORY_GRACE_STEPS, Scheduler

BLOCK = 4


def _scheduler(num_rows: int, versions: dict[str, int], max_prefills: int = 8, cache_prefixes: bool = False,
               reuse_decode_kv: bool = False, num_blocks: int = 256, prefill_wait_steps: int = 0,
               reserve_kv: bool = True) -> Scheduler:
    """A scheduler over ``num_rows`` rows whose adapters hold ``versions``, with a prefix cache of ``BLOCK``-token
    blocks (keyed only with ``cache_prefixes``) in a pool of ``num_blocks``, reserving each request's blocks to
    finish (``reserve_kv``) or not."""
    layers = {"proj": MultiLoRALinear(nn.Linear(4, 4), num_slots=4, max_rank=2, routing=LoRARouting(), trainable=False)}
    adapters = AdapterSlots(layers, pin=False)
    for name, version in versions.items():
        adapters.register(name)
        adapters.publish(name, init_adapter(layers, 2, 4.0, torch.Generator().manual_seed(0)), version)
    pool = BlockManager(num_blocks, BLOCK, num_rows, max_blocks_per_row=16, cache_prefixes=cache_prefixes)
    return Scheduler(num_rows, adapters, pool, max_prefills, reuse_decode_kv, prefill_wait_steps,
                     reserve_kv=reserve_kv)


def _request(prompt: list[int], adapter: str | None = "a") -> QueuedRequest:
    return QueuedRequest(prompt, adapter, SamplingParams(max_tokens=4), concurrent.futures.Future())


def _admit_and_place(scheduler: Scheduler) -> list[QueuedRequest]:
    """One round as the engine runs it: the prefill plan's requests, each then reported prefilled (its whole prompt
    blocks keyed) and running in its row."""
    plan = scheduler.schedule_prefill()
    for req, start in zip(plan.requests, plan.starts):
        scheduler.prefilled(req, start)
    return plan.requests


def test_requests_take_the_lowest_free_rows_in_arrival_order() -> None:
    scheduler = _scheduler(num_rows=4, versions={"a": 3})
    running = _request([1, 2], "a")
    running.row = 1
    scheduler.place(running)
    waiting = [_request([10 + i], adapter) for i, adapter in enumerate(["a", None, "a", "a"])]
    for req in waiting:
        scheduler.enqueue(req)
    assert not scheduler.idle()
    admitted = _admit_and_place(scheduler)
    assert admitted == waiting[:3] and [req.row for req in admitted] == [0, 2, 3]
    assert [req.version for req in admitted] == [3, -1, 3], "the adapter's published version, -1 for the base model"
    assert scheduler.running() == [admitted[0], running, admitted[1], admitted[2]]
    assert _admit_and_place(scheduler) == [], "no free row: the last request waits"
    scheduler.release(2)
    assert _admit_and_place(scheduler) == [waiting[3]] and waiting[3].row == 2


def test_at_most_max_prefills_per_step_are_admitted_per_round() -> None:
    scheduler = _scheduler(num_rows=8, versions={"a": 0}, max_prefills=2)
    waiting = [_request([i]) for i in range(5)]
    for req in waiting:
        scheduler.enqueue(req)
    rounds = [_admit_and_place(scheduler) for _ in range(4)]
    assert rounds == [waiting[0:2], waiting[2:4], waiting[4:5], []]
    assert [req.row for req in waiting] == [0, 1, 2, 3, 4]


def test_while_rows_decode_requests_wait_for_a_fuller_prefill_or_their_deadline() -> None:
    """With ``prefill_wait_steps=3`` a request waits while rows run until 3 decode steps passed since the oldest
    waiting one was queued, or until ``max_prefills_per_step`` wait; with no row running it goes at once."""
    scheduler = _scheduler(num_rows=8, versions={"a": 0}, max_prefills=3, prefill_wait_steps=3)
    first = _request([1])
    scheduler.enqueue(first)
    assert _admit_and_place(scheduler) == [first], "nothing runs: no reason to wait"
    early, late = _request([2]), _request([3])
    scheduler.enqueue(early)
    scheduler.decode_launched()
    scheduler.enqueue(late)
    scheduler.decode_launched()
    assert _admit_and_place(scheduler) == [], "2 steps since the oldest was queued, 2 waiting of 3"
    scheduler.decode_launched()
    assert _admit_and_place(scheduler) == [early, late], "the oldest's deadline takes the younger one along"
    batch = [_request([4 + i]) for i in range(3)]
    for req in batch[:2]:
        scheduler.enqueue(req)
    assert _admit_and_place(scheduler) == []
    scheduler.enqueue(batch[2])
    assert _admit_and_place(scheduler) == batch, "max_prefills_per_step waiting: a full pass goes now"
    for req in (first, early, late, *batch):
        scheduler.release(req.row)
    alone = _request([9])
    scheduler.enqueue(alone)
    assert _admit_and_place(scheduler) == [alone], "the rows emptied: no reason to wait"


def test_a_publish_waits_for_its_adapters_rows_and_fences_its_new_requests() -> None:
    """A publish (or unregister) lands only once its adapter holds no row, and until then the adapter's new
    requests wait while other tenants' requests and publishes go ahead."""
    scheduler = _scheduler(num_rows=4, versions={"a": 0, "b": 0, "c": 0})
    first_a, first_c = _request([1], "a"), _request([1], "c")
    scheduler.enqueue(first_a)
    scheduler.enqueue(first_c)
    assert _admit_and_place(scheduler) == [first_a, first_c]
    publish_a = Publish("a", None, 1, concurrent.futures.Future())
    publish_b = Publish("b", None, 5, concurrent.futures.Future())
    unregister_c = Unregister("c", concurrent.futures.Future())
    second_a, first_b, second_c = _request([2], "a"), _request([2], "b"), _request([2], "c")
    for item in (publish_a, second_a, publish_b, unregister_c, first_b, second_c):
        scheduler.enqueue(item)
    assert scheduler.ready_publishes() == [publish_b], "a and c still run"
    scheduler.adapters.publish("b", init_adapter(scheduler.adapters.layers, 2, 4.0, torch.Generator()), 5)
    assert _admit_and_place(scheduler) == [first_b] and first_b.version == 5 and first_b.row == 2
    assert scheduler.ready_publishes() == []
    scheduler.release(first_a.row)
    assert scheduler.ready_publishes() == [publish_a]
    assert scheduler.ready_publishes() == [], "a ready publish is handed out once"
    scheduler.adapters.publish("a", init_adapter(scheduler.adapters.layers, 2, 4.0, torch.Generator()), 1)
    scheduler.release(first_c.row)
    assert scheduler.ready_publishes() == [unregister_c]
    admitted = _admit_and_place(scheduler)
    assert admitted == [second_a, second_c] and second_a.version == 1 and [second_a.row, second_c.row] == [0, 1]


def test_a_publish_holds_back_requests_that_arrive_after_it_only_while_pending() -> None:
    scheduler = _scheduler(num_rows=2, versions={"a": 0})
    running = _request([1])
    scheduler.enqueue(running)
    _admit_and_place(scheduler)
    scheduler.enqueue(Publish("a", None, 1, concurrent.futures.Future()))
    late = _request([2])
    scheduler.enqueue(late)
    assert _admit_and_place(scheduler) == [], "a free row, but the version fence holds"
    scheduler.release(running.row)
    assert len(scheduler.ready_publishes()) == 1
    scheduler.adapters.publish("a", init_adapter(scheduler.adapters.layers, 2, 4.0, torch.Generator()), 1)
    assert _admit_and_place(scheduler) == [late] and late.version == 1


def test_requests_sharing_a_first_missing_block_wait_a_round_and_cached_sharers_go_together() -> None:
    scheduler = _scheduler(num_rows=16, versions={"a": 0, "b": 0}, cache_prefixes=True)
    prompt = list(range(100, 110))  # two whole blocks and a part
    group = [_request(prompt, "a") for _ in range(3)]
    other_prompt, other_adapter = _request(list(range(200, 210)), "a"), _request(prompt, "b")
    for req in (group[0], group[1], other_prompt, group[2], other_adapter):
        scheduler.enqueue(req)
    assert _admit_and_place(scheduler) == [group[0], other_prompt, other_adapter], \
        "the group's later samples wait for its first; another prompt or adapter does not"
    assert [group[0].row, other_prompt.row, other_adapter.row] == [0, 1, 2]
    assert _admit_and_place(scheduler) == group[1:] and [req.row for req in group[1:]] == [3, 4]
    turns = [_request(prompt[:8] + [i] * 6, "a") for i in (1, 2)]  # the cached blocks, then a block each of their own
    same = [_request(prompt[:8] + [9] * 6, "a") for _ in range(2)]  # the cached blocks, then one block both compute
    for req in (*turns, *same):
        scheduler.enqueue(req)
    assert _admit_and_place(scheduler) == [*turns, same[0]], "same[1] waits a round though rows are free"
    assert _admit_and_place(scheduler) == [same[1]] and same[1].row == 8


def test_a_request_extending_a_stored_history_takes_it_and_is_not_held_back() -> None:
    scheduler = _scheduler(num_rows=4, versions={"a": 2}, cache_prefixes=True, reuse_decode_kv=True)
    history = list(range(100, 110))
    scheduler.blocks.grow(3, 3)
    history_blocks = list(scheduler.blocks.row_blocks[3])
    scheduler.blocks.keep_history(3, "a", 2, history)
    fresh, extending = _request(history + [1, 2, 3]), _request(history + [1, 2, 3])
    scheduler.enqueue(fresh)
    scheduler.enqueue(extending)
    plan = scheduler.schedule_prefill()
    assert plan.requests == [fresh, extending], "the first takes the history, the second computes"
    assert plan.starts == [len(history), 0] and scheduler.blocks.row_blocks[fresh.row][:3] == history_blocks


@pytest.mark.parametrize("admission", ["fifo", "fair"])
def test_a_next_turn_whose_history_is_kept_waits_ahead_of_fresh_requests(admission: str) -> None:
    """One row. Episode e's first turn runs and finishes (its K/V kept as a history) while three fresh requests of
    the same tenant queue; e's next turn, queued after them, is admitted first and takes the history, then the fresh
    ones in arrival order. A preempted request waits ahead of both."""
    layers = {"proj": MultiLoRALinear(nn.Linear(4, 4), num_slots=4, max_rank=2, routing=LoRARouting(), trainable=False)}
    adapters = AdapterSlots(layers, pin=False)
    adapters.register("a")
    adapters.publish("a", init_adapter(layers, 2, 4.0, torch.Generator().manual_seed(0)), 0)
    pool = BlockManager(256, BLOCK, 1, max_blocks_per_row=16, cache_prefixes=True)
    scheduler = Scheduler(1, adapters, pool, 8, reuse_decode_kv=True, admission=admission)
    first = _request(list(range(100, 110)))
    scheduler.enqueue(first)
    assert _admit_and_place(scheduler) == [first]
    fresh = [_request([i] * 6) for i in range(3)]
    for req in fresh:
        scheduler.enqueue(req)
    first.output = [7, 8, 9]
    scheduler.finish(first)
    next_turn = _request(first.prompt_ids + first.output + [1, 2])
    scheduler.enqueue(next_turn)
    assert next_turn.resumes and not any(req.resumes for req in fresh)
    plan = scheduler.schedule_prefill()
    assert plan.requests == [next_turn] and plan.starts == [len(first.prompt_ids) + 2]
    scheduler.prefilled(next_turn, plan.starts[0])
    scheduler.release(next_turn.row)
    assert _admit_and_place(scheduler) == [fresh[0]]
    scheduler.release(fresh[0].row)
    scheduler.requeue(fresh[0])
    assert _admit_and_place(scheduler) == [fresh[0]], "a preempted request waits first"
    scheduler.release(fresh[0].row)
    assert [_admit_and_place(scheduler) + [scheduler.release(0)] for _ in range(2)] == [[fresh[1], None],
                                                                                         [fresh[2], None]]


def test_a_fresh_request_takes_a_kept_turn_only_once_it_is_older_than_the_grace() -> None:
    """A pool of 8 blocks of 4 tokens, two rows: a finished turn is kept (3 blocks) and a long request runs. A fresh
    request that fits only if the kept turn goes waits while the turn is younger than HISTORY_GRACE_STEPS decode
    steps, and takes its blocks once it is older."""
    scheduler = _scheduler(num_rows=2, versions={"a": 0}, cache_prefixes=True, reuse_decode_kv=True, num_blocks=8)
    turn = _request(list(range(100, 110)))
    scheduler.enqueue(turn)
    assert _admit_and_place(scheduler) == [turn]
    turn.output = [1, 2]
    scheduler.finish(turn)  # kept: 11 tokens in 3 blocks
    runner = QueuedRequest([7] * 4, "a", SamplingParams(max_tokens=4), concurrent.futures.Future())
    scheduler.enqueue(runner)
    assert _admit_and_place(scheduler) == [runner]  # 1 block, 1 more reserved
    fresh = QueuedRequest([9] * 8, "a", SamplingParams(max_tokens=4), concurrent.futures.Future())
    scheduler.enqueue(fresh)  # 2 prompt blocks + 1 copy + 1 to finish: 4 of the 8 - 3 - 2 = 3 available
    assert scheduler.admit().requests == [] and scheduler.blocks.has_history("a", 0, turn.prompt_ids + [1, 2, 3])
    for _ in range(HISTORY_GRACE_STEPS):
        scheduler.decode_launched()
    assert scheduler.admit().requests == [], "kept HISTORY_GRACE_STEPS steps ago: not older than the grace"
    scheduler.decode_launched()
    assert scheduler.admit().requests == [fresh] and not scheduler.blocks.has_history("a", 0, turn.prompt_ids + [1, 2])


def test_cancelled_requests_are_dropped() -> None:
    scheduler = _scheduler(num_rows=4, versions={"a": 0})
    cancelled, kept = _request([1]), _request([2])
    scheduler.enqueue(cancelled)
    scheduler.enqueue(kept)
    assert cancelled.future.cancel()
    assert _admit_and_place(scheduler) == [kept] and kept.row == 0 and cancelled.row == -1
    scheduler.release(kept.row)
    assert scheduler.idle(), "the cancelled request no longer waits"


def test_waiting_requests_of_an_unregistered_adapter_fail() -> None:
    scheduler = _scheduler(num_rows=4, versions={"a": 0, "b": 0})
    first_a, first_b, second_a = _request([1], "a"), _request([1], "b"), _request([2], "a")
    for req in (first_a, first_b, second_a):
        scheduler.enqueue(req)
    scheduler.unregister("a")
    for req in (first_a, second_a):
        with pytest.raises(ValueError, match="adapter 'a' was unregistered"):
            req.future.result(timeout=0)
    assert not first_b.future.done()
    assert _admit_and_place(scheduler) == [first_b] and first_b.row == 0


def test_a_request_whose_adapter_left_before_admission_fails_alone() -> None:
    scheduler = _scheduler(num_rows=4, versions={"a": 0, "b": 0})
    orphan, kept = _request([1], "b"), _request([1], "a")
    scheduler.enqueue(orphan)
    scheduler.enqueue(kept)
    scheduler.adapters.clear("b")  # as if its unregister landed between the submit and the admission
    assert _admit_and_place(scheduler) == [kept] and kept.row == 0
    with pytest.raises(ValueError, match="adapter 'b' was unregistered"):
        orphan.future.result(timeout=0)


def test_admission_stops_at_the_first_request_the_block_pool_cannot_take() -> None:
    """A pool of 12 blocks of 4 tokens keeps one available (its watermark): a 17-token prompt costs 6 blocks
    (5 and one for a copy on write), so two are admitted and the third waits, with the one behind it (first
    come, first served) although that one is small; a prompt longer than the whole pool fails alone; a
    preempted request is queued first. (Admission by prompt alone: reserve_kv=False.)"""
    scheduler = _scheduler(num_rows=8, versions={"a": 0}, num_blocks=12, reserve_kv=False)
    assert scheduler.watermark == 1
    big = [_request(list(range(i * 100, i * 100 + 17))) for i in range(3)]
    small, huge = _request([7]), _request(list(range(60)))
    for req in (*big, huge, small):
        scheduler.enqueue(req)
    admitted = scheduler.admit().requests
    assert admitted == big[:1], "alone, the first fits with no watermark; the second would leave none"
    for req in admitted:
        scheduler.place(req)
        scheduler.blocks.grow(req.row, 6)
    assert isinstance(huge.future.exception(timeout=0), MemoryError)
    assert "sampler.gpu_memory_utilization" in str(huge.future.exception(timeout=0))
    assert scheduler.admit().requests == [], "5 blocks available cannot take 6 more: the small request waits behind"
    scheduler.release(big[0].row)
    scheduler.requeue(big[0])
    assert scheduler.admit().requests == [big[0]], "the preempted request goes first (the next one would leave no watermark)"


def test_admission_reserves_the_blocks_each_request_needs_to_finish() -> None:
    """A pool of 20 blocks of 4 tokens (watermark 1); 4-token prompts asking for 16 tokens end holding 5 blocks
    each, and admitting one takes 2 (its prompt's block and one for a copy on write): 6 in all. The first is
    admitted, then two more (20 - 3 x 6 = 2 left); the fourth waits. As the running rows grow into their
    reservations the waiting request still waits, and is admitted once one finishes; growing every running row
    to its end never needs a preemption. Alone, a request needs only its prompt's blocks."""
    scheduler = _scheduler(num_rows=8, versions={"a": 0}, num_blocks=20)
    requests = [QueuedRequest([i] * 4, "a", SamplingParams(max_tokens=16), concurrent.futures.Future())
                for i in range(4)]
    assert scheduler.blocks_to_finish(requests[0]) == 5
    for req in requests:
        scheduler.enqueue(req)
    assert _admit_and_place(scheduler) == requests[:3]
    assert scheduler.reserved_blocks() == 3 * 4 and scheduler.blocks.available() == 20 - 3
    running = np.array([req.row for req in requests[:3]])
    for count in range(2, 6):
        assert scheduler.make_room(running, np.full(3, count)) == ([], [])
        assert scheduler.admit().requests == [], "the fourth waits for a reservation to end"
    assert scheduler.reserved_blocks() == 0 and scheduler.blocks.available() == 5
    scheduler.release(requests[0].row)
    assert _admit_and_place(scheduler) == [requests[3]]
    huge = QueuedRequest([9] * 4, "a", SamplingParams(max_tokens=100), concurrent.futures.Future())
    scheduler.enqueue(huge)
    for req in requests[1:]:
        scheduler.release(req.row)
    assert scheduler.admit().requests == [huge], "alone, the prompt's blocks are enough"


def test_make_room_preempts_the_latest_placed_request_and_fails_one_that_is_alone() -> None:
    """A pool of 7 blocks: three 4-token prompts take one block each. Row 0 growing to 6 blocks preempts the
    request placed last (C, its output dropped); growing to 8 then preempts B and, alone and still short, fails A.
    The preempted requests wait first, in arrival order. (Admission by prompt alone: reserve_kv=False.)"""
    scheduler = _scheduler(num_rows=4, versions={"a": 0}, num_blocks=7, reserve_kv=False)
    a, b, c = (_request([i, i, i, i]) for i in (1, 2, 3))
    for req in (a, b, c):
        scheduler.enqueue(req)
    assert _admit_and_place(scheduler) == [a, b, c]
    c.output = [5, 6]
    assert scheduler.make_room(np.array([0, 1, 2]), np.array([6, 1, 1])) == ([2], [])
    assert scheduler.running() == [a, b] and scheduler.blocks.row_counts[0] == 6
    assert c.row == -1 and c.output == [] and not c.future.done()
    assert scheduler.make_room(np.array([0, 1]), np.array([8, 1])) == ([1], [0])
    with pytest.raises(MemoryError, match="sampler.gpu_memory_utilization"):
        a.future.result(timeout=0)
    assert scheduler.running() == [] and scheduler.blocks.held_blocks() == 0
    assert scheduler.schedule_prefill().requests == [b, c]


def test_a_prefill_plan_copies_the_keyed_block_its_row_writes_into() -> None:
    """A prompt of two whole blocks, cached: the next request with it adopts both but writes its last token's K/V
    into the second, so the plan gives its row a copy of that block (and the copy's source)."""
    scheduler = _scheduler(num_rows=4, versions={"a": 0}, cache_prefixes=True)
    prompt = list(range(100, 108))
    first, second = _request(prompt), _request(prompt)
    scheduler.enqueue(first)
    scheduler.enqueue(second)
    assert _admit_and_place(scheduler) == [first], "the second waits for the first's keyed blocks"
    keyed = list(scheduler.blocks.row_blocks[first.row])
    plan = scheduler.schedule_prefill()
    assert plan.requests == [second] and plan.starts == [7]
    own = scheduler.blocks.row_blocks[second.row]
    assert own[0] == keyed[0] and own[1] != keyed[1] and plan.copies == ([keyed[1]], [own[1]])
    assert scheduler.changed_tables() is scheduler.blocks.tables and scheduler.changed_tables() is None


def test_a_landing_publish_drops_its_adapters_prefixes_and_a_finish_keeps_a_history() -> None:
    scheduler = _scheduler(num_rows=4, versions={"a": 0, "b": 0}, cache_prefixes=True, reuse_decode_kv=True)
    prompt = list(range(100, 108))
    reqs = [_request(prompt, "a"), _request(prompt, "b")]
    for req in reqs:
        scheduler.enqueue(req)
    assert _admit_and_place(scheduler) == reqs
    reqs[0].output = [7, 8, 9]
    scheduler.finish(reqs[0])
    assert scheduler.rows[0] is None
    assert scheduler.blocks.take_history("a", 0, prompt + [7, 8, 9])[0] == len(prompt) + 2, "every token but the last"
    scheduler.enqueue(Publish("a", None, 1, concurrent.futures.Future()))
    assert len(scheduler.ready_publishes()) == 1
    assert scheduler.blocks.lookup("a", 0, prompt) == [] and len(scheduler.blocks.lookup("b", 0, prompt)) == 2


def test_an_adapter_takes_a_free_slot_then_the_least_recently_used_idle_ones_and_drains_a_busy_one() -> None:
    """Four slots. a-d take the free ones; with a and c idle, e and f take theirs (least recently used first) and b
    finds its own. Then every slot's adapter is busy: a waits, and a busy adapter is drained for it: not d, the least
    recently used, which has a request queued behind a's (it runs), but e, the least recently used with none."""
    scheduler = _scheduler(num_rows=8, versions={name: 0 for name in "abcdef"})
    first = {name: _request([1], name) for name in "abcd"}
    for req in first.values():
        scheduler.enqueue(req)
    plan = scheduler.schedule_prefill()
    assert (plan.loads, plan.evictions, plan.hits) == (list("abcd"), 0, 0)
    assert [req.lora_slot for req in plan.requests] == [0, 1, 2, 3]
    for req in plan.requests:
        scheduler.prefilled(req, 0)
    scheduler.release(first["a"].row)
    scheduler.release(first["c"].row)
    second = [_request([2], name) for name in "efb"]
    for req in second:
        scheduler.enqueue(req)
    plan = scheduler.schedule_prefill()
    assert (plan.loads, plan.evictions, plan.hits) == (["e", "f"], 2, 1)
    assert [req.lora_slot for req in plan.requests] == [0, 2, 1], "e and f in a's and c's slots"
    assert not scheduler.adapters.resident("a") and not scheduler.adapters.resident("c")
    for req in plan.requests:
        scheduler.prefilled(req, 0)
    waiting, queued_d, other = _request([3], "a"), _request([3], "d"), _request([3], "b")
    for req in (waiting, queued_d, other):
        scheduler.enqueue(req)
    plan = scheduler.schedule_prefill()
    assert plan.requests == [queued_d, other] and (plan.loads, plan.hits) == ([], 2)
    for req in plan.requests:
        scheduler.prefilled(req, 0)
    scheduler.release(second[0].row)  # e's request ends: its slot is a's
    plan = scheduler.schedule_prefill()
    assert plan.requests == [waiting] and (plan.loads, plan.evictions) == (["a"], 1) and waiting.lora_slot == 0
    assert scheduler.adapters.lru() == ["f", "d", "b", "a"]
