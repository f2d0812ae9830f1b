"""Fair admission (skyrl_clora.sampler.fair_share, ``admission="fair"``: virtual-token counters, kept by the
scheduler): a tenant flooding the queue cannot delay another tenant's request by more than one admission of each other
active tenant, where arrival order (``"fifo"``) makes it wait for the whole flood; a tenant active again after idling
is lifted to the least served active tenant's counter; each tenant is charged exactly for its own prompt tokens and
decode steps, and a tenant stopped and added again starts anew; an episode under way goes on ahead of fresh requests;
the engine samples every request the same under either order, and keeps each tenant's queue waits. With fewer device
slots than tenants, a resident tenant keeps its slot until it is its slot credit ahead of a waiting tenant, and no
longer."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.block_manager import BlockManager
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.fair_share import DECODE_WEIGHT, PREFILL_WEIGHT
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import QueuedRequest, SamplingParams, Unregister
from skyrl_clora.sampler.scheduler import Scheduler

from tests.support.helpers import random_adapter
from tests.support.scheduler_rounds import enqueue as _enqueue
from tests.support.scheduler_rounds import run_one_step as _round_of
from tests.support.scheduler_rounds import scheduler_for as _scheduler
from tests.support.scheduler_rounds import start as _start

MAX_ROUNDS = 3000  # a bound on every engine-driving loop below: reaching it fails the test


def _round(scheduler: Scheduler) -> list[QueuedRequest]:
    """One round: the admitted requests run one decode step and finish (their rows freed)."""
    plan = scheduler.schedule_prefill()
    _round_of(scheduler, plan)
    return plan.requests


def _admissions_before_late_request(admission: str, flooders: int, each: int, rows: int,
                                    slot_credit: float = 0.0) -> int:
    """``flooders`` tenants queue ``each`` requests apiece; after the first round one request of tenant ``late``
    arrives: how many other requests are admitted from its arrival until it is."""
    tenants = [f"t{i}" for i in range(flooders)]
    scheduler = _scheduler(tenants + ["late"], rows, admission, slot_credit=slot_credit)
    for _ in range(each):
        for tenant in tenants:
            _enqueue(scheduler, tenant)
    assert len(_round(scheduler)) == rows
    late = _enqueue(scheduler, "late")
    before = 0
    for _ in range(flooders * each):
        admitted = _round(scheduler)
        if late in admitted:
            return before + admitted.index(late)
        before += len(admitted)
    raise AssertionError("the late request was never admitted")


@pytest.mark.parametrize(("flooders", "each", "rows"), [(1, 40, 1), (8, 10, 2), (255, 3, 8)])
def test_a_flood_delays_another_tenants_request_by_at_most_one_admission_per_active_tenant(
        flooders: int, each: int, rows: int) -> None:
    """Under fair admission the late request waits for at most one admission of each flooding tenant (those tied
    with it at the smallest counter, itself lifted there), with or without a slot credit (a slot is free for it); in
    arrival order it waits for the whole queued flood."""
    queued_after_first_round = flooders * each - rows
    assert _admissions_before_late_request("fifo", flooders, each, rows) == queued_after_first_round
    for slot_credit in (0.0, 1000.0):
        assert (_admissions_before_late_request("fair", flooders, each, rows, slot_credit)
                <= flooders < queued_after_first_round)


def test_a_tenant_active_again_is_lifted_to_the_least_served_active_tenant_and_banks_no_idle_time() -> None:
    """b runs once beside a, idles while a runs six requests alone, then queues four as a queues four: b's counter
    is lifted to a's, so the two alternate; without the lift b would take its four first."""
    scheduler = _scheduler(["a", "b"], num_rows=1, admission="fair")
    _enqueue(scheduler, "a")
    _enqueue(scheduler, "b")
    assert [req.adapter for _ in range(2) for req in _round(scheduler)] == ["a", "b"]
    served = PREFILL_WEIGHT * 6 + DECODE_WEIGHT  # one 6-token prompt and one decode step
    for _ in range(6):
        _enqueue(scheduler, "a")
        assert [req.adapter for req in _round(scheduler)] == ["a"]
    assert (scheduler.service.value("a"), scheduler.service.value("b")) == (7 * served, served)
    for _ in range(4):
        _enqueue(scheduler, "a")
    for _ in range(4):
        _enqueue(scheduler, "b")
    order = [req.adapter for _ in range(8) for req in _round(scheduler)]
    assert order == ["a", "b"] * 4
    assert scheduler.service.value("b") == scheduler.service.value("a") == 11 * served


def test_fair_and_fifo_admission_sample_every_request_alike_and_record_each_tenants_queue_waits(
        micro_model_dir: Path) -> None:
    """Tenant a queues twelve requests, then b, c and d two each, on four rows: the two orders finish the requests
    in different orders, each with the same tokens and log-probs (the CPU engine's rows are batch-invariant), and
    each tenant's finished requests are counted in its queue waits."""
    layers = attach_engine_lora(AutoModelForCausalLM.from_pretrained(micro_model_dir).eval(), 4, 8)[1]
    weights = {name: random_adapter(layers, seed) for seed, name in enumerate("abcd")}
    submitted = [("a", k) for k in range(12)] + [(name, k) for k in range(2) for name in "bcd"]
    results, finish_order = {}, {}
    for admission in ("fifo", "fair"):
        model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
        _, layers = attach_engine_lora(model, num_slots=4, max_rank=8)
        engine = Engine(model, layers, EngineConfig(num_rows=4, max_len=64, admission=admission))
        for name, adapter in weights.items():
            engine.adapters.register(name)
            engine.adapters.publish(name, engine.adapters.host_copy(adapter), 0)
        futures = {}
        for name, k in submitted:
            futures[name, k] = concurrent.futures.Future()
            engine.scheduler.enqueue(QueuedRequest(list(range(5, 15 + k)), name,
                                                   SamplingParams(max_tokens=4 + k % 3, seed=k), futures[name, k]))
        finished: list[tuple[str, int]] = []
        for _ in range(MAX_ROUNDS):
            if len(finished) == len(submitted):
                break
            engine.step()
            finished += [key for key, future in futures.items() if future.done() and key not in finished]
        assert len(finished) == len(submitted), f"not done after {MAX_ROUNDS} rounds"
        results[admission] = {key: (f.result().token_ids, f.result().logprobs) for key, f in futures.items()}
        finish_order[admission] = finished
        waits = engine.recorder.queue_waits()
        assert {name: w["requests"] for name, w in waits.items()} == {"a": 12, "b": 2, "c": 2, "d": 2}
        assert all(0 <= w["p50_s"] <= w["p99_s"] <= w["max_s"] <= w["total_s"] for w in waits.values())
    assert results["fair"] == results["fifo"]
    assert len({tuple(logprobs) for _, logprobs in results["fifo"].values()}) == len(submitted)
    last_b = {admission: order.index(("b", 1)) for admission, order in finish_order.items()}
    assert last_b["fair"] < last_b["fifo"], "fair admission serves b before a's flood is through"


def test_a_resident_tenant_keeps_its_slot_until_it_is_its_credit_ahead_of_a_waiting_tenant_then_it_is_drained() -> None:
    """One slot, held by a (running); c needs it while a queues a request every round and every running request
    decodes. Within the credit a's requests are admitted ahead of c and the slot is not drained for c; the round a's
    counter passes c's by more than the credit, a is drained for c (a's request waits), and c takes the slot once a's
    rows finish. Without a credit a is drained the first round it is ahead of c at all."""
    for slot_credit in (0.0, 200.0):
        scheduler = _scheduler(["a", "c"], num_rows=64, admission="fair", num_slots=1, slot_credit=slot_credit)
        _enqueue(scheduler, "a")
        _start(scheduler, scheduler.schedule_prefill())  # a holds the slot and keeps running
        c = _enqueue(scheduler, "c")  # lifted to a's counter: tied
        drained_at = None
        for round_index in range(100):
            held_a = _enqueue(scheduler, "a")
            plan = scheduler.schedule_prefill()
            if held_a not in plan.requests:
                drained_at = round_index
                assert not plan.requests and not plan.loads
                assert scheduler.service.value("a") - slot_credit > scheduler.service.value("c")
                break
            assert [req.adapter for req in plan.requests] == ["a"] and plan.hits == 1 and not plan.loads
            before = scheduler.service.value("a") - PREFILL_WEIGHT * 6  # a's counter when this round began
            assert before - slot_credit <= scheduler.service.value("c")
            _start(scheduler, plan)
            scheduler.decode_launched()
        assert drained_at == 1 if slot_credit == 0 else drained_at is not None and drained_at > 1
        for req in scheduler.running():
            scheduler.release(req.row)
        plan = scheduler.schedule_prefill()
        assert c in plan.requests and plan.loads == ["c"] and plan.evictions == 1
        assert not scheduler.adapters.resident("a")


def test_each_tenant_is_charged_exactly_for_its_own_rows_over_many_decode_steps() -> None:
    """Three tenants keep 5, 2 and 1 rows running (eight rows), each request for its own number of decode steps, a
    new one of its tenant queued as one ends (another prompt length), for 60 decode steps: each tenant's counter is
    PREFILL_WEIGHT per prompt token it had admitted plus DECODE_WEIGHT per decode step per row of its own, to the
    unit; a counter charged for another tenant's rows (or for all running rows) differs."""
    rows = {"a": 5, "b": 2, "c": 1}
    scheduler = _scheduler(list(rows), num_rows=8, admission="fair")
    want = dict.fromkeys(rows, 0.0)
    left: dict[int, int] = {}  # id of a running request -> decode steps it still runs
    arrivals = 0

    def queue(tenant: str) -> None:
        nonlocal arrivals
        arrivals += 1
        _enqueue(scheduler, tenant, prompt_len=3 + arrivals % 7)

    for tenant, count in rows.items():
        for _ in range(count):
            queue(tenant)
    for _ in range(60):
        plan = scheduler.schedule_prefill()
        for req, start in zip(plan.requests, plan.starts):
            scheduler.prefilled(req, start)
            want[req.adapter] += PREFILL_WEIGHT * len(req.prompt_ids)
            left[id(req)] = 1 + (len(req.prompt_ids) * 5 + len(left)) % 11
        running = scheduler.running()
        assert sorted(req.adapter for req in running) == sorted(t for t, n in rows.items() for _ in range(n))
        scheduler.decode_launched()
        for req in running:
            want[req.adapter] += DECODE_WEIGHT
            left[id(req)] -= 1
            if not left[id(req)]:
                scheduler.release(req.row)
                queue(req.adapter)
    assert {tenant: scheduler.service.value(tenant) for tenant in rows} == want
    assert want["a"] > 2 * want["b"] > 2 * want["c"] > 0


def test_a_tenant_stopped_and_added_again_under_its_name_starts_as_a_new_tenant() -> None:
    """a is served six times beside b's one, then unregistered and registered again; it queues with b and a new
    tenant c while no tenant is active: its old service is forgotten, so it starts from zero as c does, and both are
    served before b (kept, a tenant would wait for the others to catch up with its old service)."""
    scheduler = _scheduler(["a", "b", "c"], num_rows=1, admission="fair")
    _enqueue(scheduler, "b")
    for _ in range(6):
        _enqueue(scheduler, "a")
    for _ in range(7):
        _round(scheduler)
    served = PREFILL_WEIGHT * 6 + DECODE_WEIGHT
    assert (scheduler.service.value("a"), scheduler.service.value("b")) == (6 * served, served)
    scheduler.enqueue(Unregister("a", concurrent.futures.Future()))
    assert [item.adapter for item in scheduler.ready_publishes()] == ["a"]
    scheduler.adapters.clear("a")
    scheduler.adapters.register("a")
    scheduler.adapters.publish("a", scheduler.adapters.host_copy(scheduler.adapters.read("b", 2, 4.0)), 0)
    for _ in range(2):
        for tenant in ("b", "a", "c"):
            _enqueue(scheduler, tenant)
    assert [req.adapter for _ in range(6) for req in _round(scheduler)] == ["a", "c", "b"] * 2
    assert scheduler.service.value("a") == scheduler.service.value("c") == scheduler.service.value("b") - served


def test_an_episode_under_way_goes_on_ahead_of_a_less_served_tenants_fresh_requests() -> None:
    """One row, fair admission. a's first turn runs while b queues two fresh requests (b is lifted to a's counter
    as it becomes active, then a is charged three more decode steps); a's turn finishes (kept as a history) and a
    queues its next turn: the next turn goes first although b is now less served (fairness picks which episodes
    start, not which started one goes on), then b's two."""
    layers = {"proj": MultiLoRALinear(nn.Linear(4, 4), num_slots=2, max_rank=2, routing=LoRARouting(), trainable=False)}
    adapters = AdapterSlots(layers, pin=False)
    for name in ("a", "b"):
        adapters.register(name)
        adapters.publish(name, init_adapter(layers, 2, 4.0, torch.Generator().manual_seed(0)), 0)
    pool = BlockManager(256, 4, 1, max_blocks_per_row=16, cache_prefixes=True)
    scheduler = Scheduler(1, adapters, pool, 8, reuse_decode_kv=True, admission="fair")
    first = _enqueue(scheduler, "a", prompt_len=10)
    _start(scheduler, scheduler.schedule_prefill())
    fresh = [_enqueue(scheduler, "b", prompt_len=6) for _ in range(2)]
    assert scheduler.schedule_prefill().requests == [], "the one row is taken; b becomes active"
    for _ in range(3):
        scheduler.decode_launched()
    first.output = [7, 8, 9]
    scheduler.finish(first)
    assert scheduler.service.value("a") == scheduler.service.value("b") + 3 * DECODE_WEIGHT
    next_turn = QueuedRequest(first.prompt_ids + first.output + [1], "a", SamplingParams(max_tokens=4),
                              concurrent.futures.Future())
    scheduler.enqueue(next_turn)
    assert [req for _ in range(3) for req in _round(scheduler)] == [next_turn, *fresh]
