"""Who owns an engine's adapter slot (skyrl_clora.sampler.engine over its AdapterSlots) while tenants stop, come back
and crowd a few slots: a stopped tenant owns no slot and no record (version, host copy, cached prefixes, fair
counter); one added again under its name, or a new name, owns only the slot it is given, and its first publish lands
there alone; an adapter with requests running keeps its slot whatever the least-recently-used order says. Through all
of it every other tenant samples, token for token and log-prob for log-prob, what it samples alone (the CPU engine's
rows are batch-invariant)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.sampler.engine import Engine

from tests.support.engine_driver import (
    PROMPT, make_adapters, make_engine, publish, register, run_until, sampled, submit, unregister,
)

PROMPTS = [PROMPT, list(range(30, 48)), list(range(60, 86)), list(range(7, 40, 2))]


@dataclass
class Asked:
    """One request a test submitted, with what a reference engine needs to sample it again: the reference adapter
    of each version its tenant may sample it with, its prompt, seed and max_tokens, and ``k``, its index in its
    tenant's requests (requests of one ``k`` share prompt, seed and max_tokens across tenants)."""

    by_version: dict[int, str]
    future: concurrent.futures.Future
    prompt: list[int]
    seed: int
    max_tokens: int
    k: int

    @property
    def reference(self) -> str:
        """The reference adapter it was sampled with (once completed)."""
        return self.by_version[self.future.result().adapter_version]


def ask(engine: Engine, asked: list[Asked], tenant: str, by_version: dict[int, str], k: int
        ) -> concurrent.futures.Future:
    """Submits ``tenant``'s ``k``-th request and records it in ``asked``."""
    prompt, seed, max_tokens = PROMPTS[k % len(PROMPTS)], 1000 + k, 3 + (5 * k) % 9
    future = submit(engine, tenant, seed, max_tokens=max_tokens, prompt=prompt)
    asked.append(Asked(by_version, future, prompt, seed, max_tokens, k))
    return future


def _sampled_alone(model_dir: Path, weights: dict[str, AdapterWeights], completed: list[Asked]) -> list[tuple]:
    """Each completed request sampled again on an engine with a slot per reference adapter."""
    reference = make_engine(model_dir, slots=len(weights), num_rows=4)
    register(reference, weights)
    futures = [submit(reference, req.reference, req.seed, max_tokens=req.max_tokens, prompt=req.prompt)
               for req in completed]
    run_until(reference, lambda: all(future.done() for future in futures))
    return [sampled(future.result()) for future in futures]


def _assert_slot_holds(engine: Engine, name: str, weights: AdapterWeights) -> None:
    """``name`` is resident and its device slot holds exactly ``weights`` (rank 8 = the slots' rank)."""
    held = engine.adapters.read(name, weights.rank, weights.alpha)
    for path in weights.a:
        assert torch.equal(held.a[path], weights.a[path]) and torch.equal(held.b[path], weights.b[path]), (name, path)


@pytest.mark.parametrize("admission", ["fifo", "fair"])
def test_tenants_stopped_and_added_again_on_scarce_slots_leave_every_other_tenant_sampling_as_alone(
        micro_model_dir: Path, admission: str) -> None:
    """Six tenants on three slots and six rows. t2 is stopped while one of its requests runs and another waits (that
    one fails; the stop lands once the running one is done) as t1 publishes; then t2 comes back under its name with
    other weights and t6 joins, while the others keep sampling and t1 publishes again. The stopped t2 owns no slot,
    no version and no cached prefix; the re-added t2's first publish lands in its slot alone (every resident slot
    holds its adapter's latest weights); every request samples what its tenant's weights of that version sample
    alone, the re-added t2 included (the same prompts and seeds as before it was stopped, other samples)."""
    names = [f"t{i}" for i in range(6)]
    weights = make_adapters(micro_model_dir, {**{name: i for i, name in enumerate(names)},
                                              "t1@1": 101, "t1@2": 102, "t2@again": 202, "t6": 6})
    engine = make_engine(micro_model_dir, slots=3, num_rows=6, block_size=8, reuse_decode_kv=True, admission=admission)
    register(engine, {name: weights[name] for name in names})
    versions = {name: {0: name} for name in names} | {"t1": {0: "t1", 1: "t1@1", 2: "t1@2"}}
    asked: list[Asked] = []
    for k in range(2):  # six tenants on three slots
        for name in names:
            ask(engine, asked, name, versions[name], k)
    run_until(engine, lambda: all(req.future.done() for req in asked))
    for name in ("t0", "t1", "t2"):  # they take the three slots
        ask(engine, asked, name, versions[name], 2)
    run_until(engine, lambda: any(req.adapter == "t2" for req in engine.scheduler.running()))
    t2_running = [req.future for req in engine.scheduler.running() if req.adapter == "t2"]
    t2_waiting = ask(engine, asked, "t2", versions["t2"], 3)
    t2_stopped = [req.future for req in asked if req.by_version is versions["t2"] and not req.future.done()]
    stop = unregister(engine, "t2")
    publish(engine, "t1", weights["t1@1"], 1)
    after_v1 = [ask(engine, asked, name, versions[name], 3) for name in ("t0", "t1")]  # resident: no slot changes hands
    run_until(engine, stop.done)

    assert stop.exception() is None
    assert all(future.done() for future in t2_stopped) and t2_waiting in t2_stopped
    for future in t2_stopped:  # those running when it was stopped finish; those waiting fail
        if future in t2_running:
            assert future.exception() is None
        else:
            with pytest.raises(ValueError, match="'t2' was unregistered"):
                future.result()
    assert "t2" not in engine.adapters and not engine.adapters.resident("t2"), "a stopped tenant owns no slot"
    assert "t2" not in engine.adapters.lru() and engine.adapters.free() == 1, "its slot is free"
    with pytest.raises(KeyError):
        engine.adapters.version("t2")
    assert all(engine.scheduler.blocks.lookup("t2", 0, prompt) == [] for prompt in PROMPTS), "no cached prefix"
    if admission == "fair":
        assert engine.scheduler.service.value("t2") == 0.0, "a stopped tenant keeps no fair counter"

    engine.adapters.register("t2")
    engine.adapters.register("t6")
    landed = [publish(engine, "t2", weights["t2@again"], 0), publish(engine, "t6", weights["t6"], 0)]
    versions |= {"t2": {0: "t2@again"}, "t6": {0: "t6"}}
    for k in range(3):
        for name in ("t2", "t6", "t3", "t4", "t5"):
            ask(engine, asked, name, versions[name], k + 3 * (name in ("t3", "t4", "t5")))
    run_until(engine, lambda: all(future.done() for future in landed) and engine.adapters.resident("t2"))
    latest = {"t0": "t0", "t1": "t1@1", "t2": "t2@again", "t3": "t3", "t4": "t4", "t5": "t5", "t6": "t6"}
    for name in engine.adapters.lru():
        _assert_slot_holds(engine, name, weights[latest[name]])
    run_until(engine, after_v1[1].done)  # t1's request after its first publish: sampled with version 1
    publish(engine, "t1", weights["t1@2"], 2)
    for k in range(3, 5):
        for name in ("t1", "t0", "t5", "t2"):
            ask(engine, asked, name, versions[name], k)
    run_until(engine, lambda: all(req.future.done() for req in asked))

    completed = [req for req in asked if req.future.exception() is None]
    assert len(completed) == len(asked) - len(t2_stopped) + len(t2_running)
    assert {req.reference for req in completed} == set(weights), "every tenant and version sampled something"
    first = {req.reference: tuple(req.future.result().logprobs) for req in completed if req.k == 0}
    assert len(first) == 8 and len(set(first.values())) == 8, "tenants' samples (one prompt and seed) must differ"
    assert engine.stats.adapter_evictions > 0, "the slots were scarce"
    got = [sampled(req.future.result()) for req in completed]
    assert got == _sampled_alone(micro_model_dir, weights, completed)


def test_an_adapter_with_a_request_running_keeps_its_slot_when_it_is_the_least_recently_used(
        micro_model_dir: Path) -> None:
    """Two slots: L's long request runs, then I's short one runs and ends, so L is the least recently used resident
    adapter but busy and I idle. A request of N then misses: I is evicted, L keeps its slot (and its contents),
    and L's and N's requests sample what they sample alone."""
    weights = make_adapters(micro_model_dir, {"L": 1, "I": 2, "N": 3})
    engine = make_engine(micro_model_dir, slots=2, num_rows=4)
    register(engine, weights)
    long_request = submit(engine, "L", seed=5, max_tokens=40)
    run_until(engine, lambda: engine.adapters.resident("L") and engine.running_rows() == 1)
    short = submit(engine, "I", seed=6, max_tokens=2)
    run_until(engine, short.done)
    assert engine.adapters.lru() == ["L", "I"] and not long_request.done()
    l_slot = engine.adapters.slot("L")
    newcomer = submit(engine, "N", seed=7, max_tokens=6)
    run_until(engine, lambda: engine.adapters.resident("N"))
    assert not engine.adapters.resident("I") and engine.adapters.slot("L") == l_slot, "the idle adapter goes"
    _assert_slot_holds(engine, "L", weights["L"])
    run_until(engine, lambda: long_request.done() and newcomer.done())

    got = [sampled(future.result()) for future in (long_request, short, newcomer)]
    assert len({tuple(result[1]) for result in got}) == 3, "tenants' samples must differ"
    reference = make_engine(micro_model_dir, slots=3, num_rows=4)
    register(reference, weights)
    alone = [submit(reference, "L", seed=5, max_tokens=40), submit(reference, "I", seed=6, max_tokens=2),
             submit(reference, "N", seed=7, max_tokens=6)]
    run_until(reference, lambda: all(future.done() for future in alone))
    assert got == [sampled(future.result()) for future in alone]
