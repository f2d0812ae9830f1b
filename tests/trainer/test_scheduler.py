"""The train scheduler (:mod:`skyrl_clora.trainer.scheduler`): swap and packed modes, lockstep rounds following the
pack plan, priorities, failures kept to their tenants, sampling paused around passes, each tenant getting back its
stored weights; and both train modes end to end."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.support.micro_task import assert_learning, micro_tenants
from skyrl_clora.main import main
from skyrl_clora.trainer.pack_plan import pack_load, plan_packs, round_seconds
from skyrl_clora.trainer.scheduler import TrainScheduler, pack_cost_model
from tests.support.two_step_demo_args import two_step_demo_args as _args
from tests.support.transport import (
    check_scheduler_returns_stored_weights,
    scheduler_batch,
    scheduler_trainer,
    submit_all,
)


def test_packed_scheduler_packs_waiting_tenants_and_fails_only_the_bad_one(micro_model_dir: Path) -> None:
    trainer = scheduler_trainer(micro_model_dir, slots=3)
    scheduler = TrainScheduler(trainer, "packed")
    results = asyncio.run(submit_all(scheduler, [("A", scheduler_batch(0)), ("B", scheduler_batch(1, bad=True)), ("C", scheduler_batch(2))]))
    assert isinstance(results[1], ValueError) and "loss mask" in str(results[1])
    assert [results[i][1]["pass_tenants"] for i in (0, 2)] == [2.0, 2.0]
    assert results[0][1]["lr"] == 1e-3 and results[2][1]["lr"] == 3e-3
    assert [trainer.store.tenants[n].step for n in "ABC"] == [1, 0, 1]
    # a pass that raises (an unknown tenant) fails the tenants in it; the next pass runs
    trainer.store.slots.pop()  # two slots: [A, ghost] in one pass, C in the next
    results = asyncio.run(submit_all(scheduler, [("A", scheduler_batch(3)), ("ghost", scheduler_batch(4)), ("C", scheduler_batch(5))]))
    assert isinstance(results[0], KeyError) and isinstance(results[1], KeyError)
    assert results[2][1]["pass_tenants"] == 1.0
    assert [trainer.store.tenants[n].step for n in "ABC"] == [1, 0, 2]
    assert all(slot.owner is None for slot in trainer.store.slots)


def test_lockstep_rounds_wait_for_every_member_and_pack_whatever_the_arrival_order(micro_model_dir: Path) -> None:
    """A round starts when every member's batch waits (not before), packs them as the plan of the batches in the
    order the tenants joined, whatever order they arrived in (batches of one shape, two slots: [A, B] then [C]),
    and trains the same bits as that packing arriving in order; a member that leaves is no longer waited for."""
    trainer, reference = scheduler_trainer(micro_model_dir, slots=2), scheduler_trainer(micro_model_dir, slots=2)
    scheduler = TrainScheduler(trainer, "packed", lockstep=True)
    for name in "ABC":
        scheduler.join(name)

    async def round_in_reverse() -> tuple[list, bool]:
        tasks = [asyncio.create_task(scheduler.train(name, scheduler_batch(seed))) for seed, name in ((2, "C"), (1, "B"))]
        await asyncio.sleep(0.05)
        early = any(task.done() for task in tasks) or trainer.store.tenants["B"].step > 0
        tasks.append(asyncio.create_task(scheduler.train("A", scheduler_batch(0))))
        return await asyncio.gather(*tasks), early

    results, early = asyncio.run(round_in_reverse())
    assert not early, "a round must wait for every member"
    assert [result[1]["pass_tenants"] for result in results] == [1.0, 2.0, 2.0]  # C alone, B with A
    want = reference.train_packed([("A", scheduler_batch(0)), ("B", scheduler_batch(1))])
    assert [results[2][1], results[1][1]] == [{**m, "pass_tenants": 2.0} for _, m in want]
    assert results[0][1] == {**reference.train_packed([("C", scheduler_batch(2))])[0][1], "pass_tenants": 1.0}
    scheduler.leave("B")
    results = asyncio.run(submit_all(scheduler, [("C", scheduler_batch(3)), ("A", scheduler_batch(4))]))
    assert [result[1]["pass_tenants"] for result in results] == [2.0, 2.0]
    with pytest.raises(ValueError, match="packed"):
        TrainScheduler(trainer, "swap", lockstep=True)


def test_lockstep_passes_follow_the_pack_plan_and_train_as_each_tenant_alone(micro_model_dir: Path) -> None:
    """Members A, B, C, D (joined in that order, two slots): A and C wait with long responses, B and D with short
    ones. The plan trains [A, C] and [B, D] (member order, [A, B] and [C, D], would pad the short rows of each
    micro-batch to the long ones: the model prices it higher), and each tenant's metrics are those of it trained
    alone, up to float rounding."""
    trainer, alone = scheduler_trainer(micro_model_dir, 2, "ABCD"), scheduler_trainer(micro_model_dir, 2, "ABCD")
    batches = {name: scheduler_batch(seed, response_len=40 if name in "AC" else 3) for seed, name in enumerate("ABCD")}
    loads = [pack_load(name, batches[name], 8) for name in "ABCD"]
    model = pack_cost_model(trainer)
    assert plan_packs(loads, 2, model) == [["A", "C"], ["B", "D"]]
    assert round_seconds([["A", "B"], ["C", "D"]], loads, model) > round_seconds([["A", "C"], ["B", "D"]], loads, model)
    passes: list[list[str]] = []
    train_packed = trainer.train_packed
    trainer.train_packed = lambda items: (passes.append([name for name, _ in items]), train_packed(items))[1]
    scheduler = TrainScheduler(trainer, "packed", lockstep=True)
    for name in "ABCD":
        scheduler.join(name)
    results = asyncio.run(submit_all(scheduler, [(name, batches[name]) for name in "DCBA"]))
    assert passes == [["A", "C"], ["B", "D"]]
    metrics = {name: result[1] for name, result in zip("DCBA", results)}
    assert all(m["pass_tenants"] == 2.0 for m in metrics.values())
    assert len({(metrics[name]["grad_norm"], metrics[name]["mean_token_logprob"]) for name in "ABCD"}) == 4, "the tenants' metrics differ, so the comparison below is not vacuous"
    for name in "ABCD":
        want = alone.train_packed([(name, batches[name])])[0][1]
        got = {key: value for key, value in metrics[name].items() if key != "pass_tenants"}
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), name


def test_swap_scheduler_trains_in_arrival_order_with_prefetch(micro_model_dir: Path) -> None:
    trainer, plain = scheduler_trainer(micro_model_dir, slots=2), scheduler_trainer(micro_model_dir, slots=1)
    scheduler = TrainScheduler(trainer, "swap")
    requests = [("B", scheduler_batch(0)), ("A", scheduler_batch(1)), ("C", scheduler_batch(2, bad=True)), ("A", scheduler_batch(3))]
    results = asyncio.run(submit_all(scheduler, requests))
    assert isinstance(results[2], ValueError)
    assert trainer.store.slot_of("C") is None  # prefetched while A trained, given back when its batch failed
    for (name, batch), result in zip(requests, results):
        if not isinstance(result, Exception):
            assert result[1] == {**plain.train_step(name, batch)[1], "pass_tenants": 1.0}
    with pytest.raises(ValueError, match="use swap or packed"):
        TrainScheduler(trainer, "fused")


@pytest.mark.parametrize("priority, order", [("arrival", ["A", "A", "B", "C"]), ("fewest_updates", ["A", "B", "C", "A"])])
def test_fewest_updates_trains_the_tenant_with_the_fewest_passes_first(micro_model_dir: Path, priority: str,
                                                                        order: list[str]) -> None:
    """A has trained once; then A, B and C wait together: by arrival A goes first again, by fewest updates B and C
    (no pass yet, in arrival order) go before A. Each pass records its tenant and its request's arrival."""
    trainer = scheduler_trainer(micro_model_dir, slots=2)
    scheduler = TrainScheduler(trainer, "swap", priority=priority)
    asyncio.run(submit_all(scheduler, [("A", scheduler_batch(0))]))
    results = asyncio.run(submit_all(scheduler, [("A", scheduler_batch(1)), ("B", scheduler_batch(2)),
                                                 ("C", scheduler_batch(3))]))
    assert not [r for r in results if isinstance(r, Exception)]
    assert [p.tenants for p in scheduler.passes] == [(name,) for name in order]
    assert all(p.arrived[0] <= p.start < p.end and not p.paused and p.rows_decoding is None for p in scheduler.passes)
    assert [trainer.store.tenants[name].step for name in "ABC"] == [2, 1, 1]
    with pytest.raises(ValueError, match="use arrival or fewest_updates"):
        TrainScheduler(trainer, "swap", priority="shortest")


@pytest.mark.parametrize("mode", ["swap", "packed"])
def test_the_scheduler_returns_each_tenants_stored_weights(micro_model_dir: Path, mode: str) -> None:
    check_scheduler_returns_stored_weights(micro_model_dir, mode)


class _RecordingSampler:
    def __init__(self, events: list[str], rows: int = 0) -> None:
        self.events = events
        self.rows = rows

    def running_rows(self) -> int:
        return self.rows

    def pause(self) -> None:
        self.events.append("pause")

    def resume(self) -> None:
        self.events.append("resume")


@pytest.mark.parametrize("mode", ["swap", "packed"])
def test_the_scheduler_pauses_sampling_around_every_pass_also_a_failing_one(micro_model_dir: Path, mode: str) -> None:
    trainer = scheduler_trainer(micro_model_dir, slots=2)
    events: list[str] = []
    for name in ("train_step", "train_packed"):
        method = getattr(trainer, name)
        setattr(trainer, name, lambda *args, method=method: (events.append("train"), method(*args))[1])
    scheduler = TrainScheduler(trainer, mode, sampler=_RecordingSampler(events))
    results = asyncio.run(submit_all(scheduler, [("A", scheduler_batch(0)), ("B", scheduler_batch(1))]))
    assert all(not isinstance(r, Exception) for r in results)
    passes = 2 if mode == "swap" else 1
    assert events == ["pause", "train", "resume"] * passes
    events.clear()
    results = asyncio.run(submit_all(scheduler, [("ghost", scheduler_batch(2))]))  # the pass raises: sampling resumes anyway
    assert isinstance(results[0], KeyError) and events == ["pause", "train", "resume"]


def test_a_pass_pauses_sampling_only_while_enough_rows_decode(micro_model_dir: Path) -> None:
    """With ``pause_rows``, a pass starting while fewer rows decode runs beside them (no pause)."""
    trainer = scheduler_trainer(micro_model_dir, slots=2)
    events: list[str] = []
    sampler = _RecordingSampler(events, rows=12)
    scheduler = TrainScheduler(trainer, "swap", sampler=sampler, pause_rows=16)
    asyncio.run(submit_all(scheduler, [("A", scheduler_batch(0))]))
    assert events == [] and scheduler.paused_passes == 0
    sampler.rows = 16
    asyncio.run(submit_all(scheduler, [("B", scheduler_batch(1))]))
    assert events == ["pause", "resume"] and scheduler.paused_passes == 1
    assert [(p.paused, p.rows_decoding) for p in scheduler.passes] == [(False, 12), (True, 16)]
    (first_start, first_end), (second_start, second_end) = scheduler.pass_intervals
    assert first_start < first_end <= second_start < second_end  # each pass's host interval, in order
    assert scheduler.pass_seconds == pytest.approx((first_end - first_start) + (second_end - second_start))


@pytest.mark.parametrize("train_mode, overlap", [("swap", "true"), ("packed", "true"), ("swap", "false")])
@pytest.mark.e2e
def test_train_modes_end_to_end(train_mode: str, overlap: str, learning_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / train_mode
    tenants = micro_tenants({"lr": "1e-3"}, {"lr": "4e-3", "rank": 8})
    assert main(_args(learning_model_dir, out, tenants, f"clora.train_mode={train_mode}",
                      f"clora.overlap_sampling={overlap}")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [row["status"] for row in summary["per_tenant"]] == ["ok", "ok"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_learning(records)
    steps = [r for r in records if r["event"] == "step"]
    assert sorted((r["tenant"], r["adapter_version"]) for r in steps) == [
        ("tenant-0", 1), ("tenant-0", 2), ("tenant-1", 1), ("tenant-1", 2)]
    assert {r["train/lr"] for r in steps} == {1e-3, 4e-3} and all(r["train/response_tokens"] > 0 for r in steps)
    assert all(1 <= r["train/pass_tenants"] <= (2 if train_mode == "packed" else 1) for r in steps)


@pytest.mark.parametrize("overlap, paused", [("null", False), ("true", False), ("false", True)])
@pytest.mark.e2e
def test_sampling_pauses_for_passes_only_when_asked_on_the_cpu(micro_model_dir: Path, tmp_path: Path, overlap: str,
                                                              paused: bool) -> None:
    from skyrl_clora.config.build import build_run_config
    from skyrl_clora.config.compose import compose_config
    from skyrl_clora.backends.embedded.services import build_services

    run = build_run_config(compose_config(_args(micro_model_dir, tmp_path, f"clora.overlap_sampling={overlap}")))
    services = build_services(run, str(micro_model_dir), num_tenants=1, rows_per_tenant=2)
    try:
        assert services.train_scheduler(run).sampler is (services.engine if paused else None)
    finally:
        services.shutdown()
