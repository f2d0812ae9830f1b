"""An admission round's decisions over the device adapter slots (skyrl_clora.sampler.slot_round, through the
scheduler and on its own): a request waits for a slot only when its adapter holds none and no slot is free or held by
an idle adapter; then one busy adapter is drained for it (the least recently used of those with nothing queued, else
of all; under fair admission only one past its slot credit), once per waiting adapter and round, whatever its queue;
an admitted request takes its adapter's slot (a hit) or a slot given to it (a load, an eviction when taken from an idle
adapter with nothing queued before one with requests waiting)."""

from __future__ import annotations

import concurrent.futures

import pytest
from torch import nn

from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.fair_share import ServiceCounters
from skyrl_clora.sampler.requests import PrefillPlan, QueuedRequest, SamplingParams
from skyrl_clora.sampler.slot_round import SlotRound

from tests.support.scheduler_rounds import enqueue as _enqueue
from tests.support.scheduler_rounds import run_one_step as _round_of
from tests.support.scheduler_rounds import scheduler_for as _scheduler
from tests.support.scheduler_rounds import start as _start


@pytest.mark.parametrize("admission", ["fifo", "fair"])
def test_a_slot_is_taken_from_an_adapter_with_nothing_queued_before_one_with_requests_waiting(admission: str) -> None:
    scheduler = _scheduler(["a", "b", "c"], num_rows=2, admission=admission, num_slots=2)
    _enqueue(scheduler, "a")
    _enqueue(scheduler, "b")
    first = scheduler.schedule_prefill()
    assert first.loads == ["a", "b"]
    _round_of(scheduler, first)
    _enqueue(scheduler, "c")  # c needs a slot; a (least recently used) has a request queued behind it, b has none
    _enqueue(scheduler, "a")
    second = scheduler.schedule_prefill()
    assert [req.adapter for req in second.requests] == ["c", "a"]
    assert (second.loads, second.evictions, second.hits) == (["c"], 1, 1)  # b gave its slot; a kept its own
    assert not scheduler.adapters.resident("b") and scheduler.adapters.resident("a")


@pytest.mark.parametrize("admission", ["fifo", "fair"])
def test_a_waiting_adapter_drains_a_busy_adapter_with_nothing_queued_before_one_with_requests_waiting(
        admission: str) -> None:
    scheduler = _scheduler(["a", "b", "c"], num_rows=3, admission=admission, num_slots=2)
    first_a, first_b = _enqueue(scheduler, "a"), _enqueue(scheduler, "b")
    first = scheduler.schedule_prefill()
    for req, start in zip(first.requests, first.starts):
        scheduler.prefilled(req, start)  # a and b keep running: every slot is busy
    _enqueue(scheduler, "c")
    _enqueue(scheduler, "a")
    second = scheduler.schedule_prefill()
    assert [req.adapter for req in second.requests] == ["a"] and second.hits == 1  # c drained b, not a
    scheduler.release(first_a.row)
    scheduler.release(first_b.row)  # b's slot is free to take (a's second request runs)
    third = scheduler.schedule_prefill()
    assert [req.adapter for req in third.requests] == ["c"] and (third.loads, third.evictions) == (["c"], 1)
    assert not scheduler.adapters.resident("b")


@pytest.mark.parametrize("admission", ["fifo", "fair"])
def test_a_round_looks_at_each_waiting_adapter_without_a_slot_once_whatever_its_queue(
        admission: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four slots held by running tenants, 40 tenants without a slot queueing 8 requests each (hundreds of tenants on
    a few slots): a round admits none of them and asks the slots about each waiting tenant once, not about each of
    its 320 requests; the queue keeps all of them in arrival order, and the next round does the same."""
    waiting = [f"w{i}" for i in range(40)]
    scheduler = _scheduler(["r0", "r1", "r2", "r3", *waiting], num_rows=400, admission=admission, num_slots=4,
                           slot_credit=1e9)  # under fair: no resident is past its credit, so no slot is drained
    for name in ("r0", "r1", "r2", "r3"):
        _enqueue(scheduler, name)
    _start(scheduler, scheduler.schedule_prefill())
    queued = [_enqueue(scheduler, name) for _ in range(8) for name in waiting]
    asked = []
    available = AdapterSlots.available
    monkeypatch.setattr(AdapterSlots, "available", lambda self, busy: asked.append(1) or available(self, busy))
    for _ in range(2):
        asked.clear()
        plan = scheduler.schedule_prefill()
        assert plan.requests == [] and plan.loads == []
        assert len(asked) == len(waiting), "one look at the slots per waiting adapter"
        assert scheduler._waiting == queued


def _slots(names: list[str], count: int, resident: list[str]) -> AdapterSlots:
    """``count`` device slots with ``names`` registered and ``resident`` given a slot each, in that order (the first
    the least recently used)."""
    layers = {"proj": MultiLoRALinear(nn.Linear(4, 4), num_slots=count, max_rank=2, routing=LoRARouting(),
                                      trainable=False)}
    slots = AdapterSlots(layers, pin=False)
    for name in names:
        slots.register(name)
    for name in resident:
        slots.assign(name, busy=set())
    return slots


def _request(adapter: str | None, prompt_len: int = 2) -> QueuedRequest:
    return QueuedRequest(list(range(prompt_len)), adapter, SamplingParams(max_tokens=1), concurrent.futures.Future())


def test_a_request_waits_only_when_its_adapter_has_no_slot_and_every_slot_is_busy() -> None:
    """a and b run in the two slots. The base model and a never wait; c waits and a (least recently used, nothing
    queued) is drained for it, once: a's next request waits behind the drain, b's does not, and c asking again drains
    nothing more."""
    slots = _slots(["a", "b", "c"], count=2, resident=["a", "b"])
    round_ = SlotRound(slots, [_request("a"), None, _request("b")], [], PrefillPlan(), None, 0.0)
    assert round_.busy == {"a", "b"}
    assert not round_.holds_back(None) and not round_.holds_back("a")
    assert round_.holds_back("c") and round_.waiting == {"c"} and round_.draining == {"a"}
    assert round_.holds_back("a"), "a drained adapter's requests wait"
    assert not round_.holds_back("b")
    assert round_.holds_back("c") and round_.draining == {"a"}, "one drain per waiting adapter"


def test_the_drained_adapter_is_the_least_recently_used_one_with_nothing_queued_else_the_least_recently_used() -> None:
    for queued, drained in ((["a"], "b"), (["a", "b"], "a"), ([], "a")):
        slots = _slots(["a", "b", "c"], count=2, resident=["a", "b"])
        queue = [_request(name) for name in queued]
        round_ = SlotRound(slots, [_request("a"), _request("b")], queue, PrefillPlan(), None, 0.0)
        assert round_.holds_back("c") and round_.draining == {drained}, queued


def test_an_idle_resident_adapters_slot_is_given_to_an_admitted_request_and_counted() -> None:
    """b holds a slot but runs nothing: c is not held back, and admitting it takes b's slot (a load and an
    eviction); admitting a, resident, is a hit that makes it the most recently used; the base model takes no slot."""
    slots = _slots(["a", "b", "c"], count=2, resident=["a", "b"])
    b_slot = slots.slot("b")
    plan = PrefillPlan()
    round_ = SlotRound(slots, [_request("a")], [], plan, None, 0.0)
    assert not round_.holds_back("c")
    c = _request("c")
    round_.admitted(c)
    assert c.lora_slot == b_slot and not slots.resident("b") and round_.busy == {"a", "c"}
    assert (plan.loads, plan.evictions, plan.hits) == (["c"], 1, 0)
    a = _request("a")
    round_.admitted(a)
    assert a.lora_slot == slots.slot("a") and slots.lru() == ["c", "a"]
    assert (plan.loads, plan.evictions, plan.hits) == (["c"], 1, 1)
    base = _request(None)
    round_.admitted(base)
    assert base.lora_slot == -1 and (plan.loads, plan.evictions, plan.hits) == (["c"], 1, 1)


def test_a_free_slot_is_a_load_without_an_eviction() -> None:
    slots = _slots(["a", "b"], count=2, resident=["a"])
    plan = PrefillPlan()
    round_ = SlotRound(slots, [_request("a")], [], plan, None, 0.0)
    b = _request("b")
    assert not round_.holds_back("b")
    round_.admitted(b)
    assert slots.resident("a") and b.lora_slot == slots.slot("b") != slots.slot("a")
    assert (plan.loads, plan.evictions, plan.hits) == (["b"], 0, 0)


def test_under_fair_admission_only_an_adapter_past_its_credit_ahead_of_the_waiting_one_is_drained() -> None:
    """Counters a 30, b 5 (both running, b the least recently used), credit 10: for c at 0, a is past its credit
    (30 - 10 > 0) and b is not, so a is drained (arrival order would drain b); for c at 25 none is, and c waits
    without draining any."""
    for c_counter, drained in ((0, {"a"}), (25, set())):
        service = ServiceCounters()
        for name, counter in (("a", 30), ("b", 5), ("c", c_counter)):
            service.admitted(_request(name, prompt_len=counter))
        assert (service.value("a"), service.value("b"), service.value("c")) == (30.0, 5.0, float(c_counter))
        slots = _slots(["a", "b", "c"], count=2, resident=["b", "a"])
        round_ = SlotRound(slots, [_request("a"), _request("b")], [], PrefillPlan(), service, 10.0)
        assert round_.holds_back("c") and round_.draining == drained, c_counter
    fifo = SlotRound(_slots(["a", "b", "c"], count=2, resident=["b", "a"]), [_request("a"), _request("b")], [],
                     PrefillPlan(), None, 10.0)
    assert fifo.holds_back("c") and fifo.draining == {"b"}
