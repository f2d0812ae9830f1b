"""The placement planner against the exact optimum on small cases (<= 8 tenants, 2-3 replicas)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks.planner import small_case
from skyrl_clora.placement.planner import (TenantCost, makespan, measured_costs, optimal_assignment, pick_move,
                                            plan_assignment, step_seconds)


def test_the_plan_is_within_5_percent_of_the_optimal_makespan_on_small_cases() -> None:
    rng = random.Random(0)
    ratios = []
    for _ in range(300):
        tenants, replicas, capacity = small_case(rng)
        plan = plan_assignment(tenants, replicas, capacity)
        costs = {t.name: t.work for t in tenants}
        assert sorted(name for names in plan for name in names) == sorted(costs), "every tenant placed once"
        assert len(plan) == replicas and all(len(names) <= capacity for names in plan)
        best, _ = optimal_assignment(tenants, replicas, capacity)
        ratios.append(makespan(plan, costs) / best)
    assert max(ratios) <= 1.05, f"worst plan {max(ratios):.3f}x the optimum"
    assert min(ratios) >= 1.0 - 1e-12, "no plan beats the exhaustive optimum"


def test_longest_first_alone_misses_what_the_swaps_find() -> None:
    """The classic case where longest-first is 7/6 of the optimum (3, 3, 2, 2, 2 on 2 replicas: 7 vs 6)."""
    tenants = [TenantCost(name, work) for name, work in zip("abcde", (3, 3, 2, 2, 2))]
    plan = plan_assignment(tenants, 2, 5)
    assert makespan(plan, {t.name: t.work for t in tenants}) == 6


def test_the_per_replica_limit_binds_and_the_plan_is_deterministic() -> None:
    tenants = [TenantCost("big", 10.0)] + [TenantCost(f"s{i}", 1.0) for i in range(5)]
    plan = plan_assignment(tenants, 2, 3)
    assert all(len(names) == 3 for names in plan)
    assert plan == plan_assignment(tenants, 2, 3)


def test_tenants_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit 2 replicas of 1"):
        plan_assignment([TenantCost(f"t{i}", 1.0) for i in range(3)], 2, 1)


def _costs(**work: float) -> list[TenantCost]:
    return [TenantCost(name, value) for name, value in work.items()]


def test_an_idle_replica_takes_the_tenant_that_best_evens_the_loads() -> None:
    # Replica 1 (4 + 3 + 1 left) is the busiest; moving its 4 leaves max(4, 4) = 4, the 3 leaves 5, the 1 leaves 7.
    loads = [[], _costs(x=4, y=3, z=1), _costs(w=5, v=1)]
    assert pick_move(loads, to=0, capacity=4) == ("x", 1)


def test_no_move_where_it_would_not_lower_the_load() -> None:
    assert pick_move([[], _costs(x=6)], to=0, capacity=4) is None, "a replica's only tenant stays"
    assert pick_move([_costs(u=5), _costs(x=1, y=1)], to=0, capacity=4) is None, "the idle side is not idle enough"
    assert pick_move([[], _costs(x=0, y=0)], to=0, capacity=4) is None, "tenants in their last step stay"
    assert pick_move([_costs(u=0), _costs(x=3, y=3)], to=0, capacity=1) is None, "the target has no free slot"
    assert pick_move([_costs(u=0), _costs(x=3, y=3)], to=0, capacity=2) == ("x", 1)


def _step(tenant: str, step: int, seconds: float) -> dict[str, object]:
    return {"event": "step", "tenant": tenant, "step": step, "rollout_s": seconds / 2, "train_s": seconds / 4,
            "sync_s": seconds / 4}


def test_step_seconds_are_the_mean_of_a_tenants_step_records() -> None:
    records = [_step("a", 1, 2.0), {"event": "eval", "tenant": "a", "step": 1}, _step("a", 2, 4.0), _step("b", 1, 1.0)]
    assert step_seconds(records) == {"a": 3.0, "b": 1.0}


def test_measured_costs_scale_the_estimates_of_tenants_not_measured_yet() -> None:
    per_step = _costs(a=100, b=100, fresh=300)  # estimated units per step
    steps_left = {"a": 4, "b": 4, "fresh": 10}
    # a and b: 2 s and 6 s a step for 200 units, so 0.04 s a unit; fresh: 300 units a step -> 12 s a step.
    costs = {cost.name: cost.work for cost in measured_costs(per_step, steps_left, {"a": 2.0, "b": 6.0})}
    assert costs == pytest.approx({"a": 8.0, "b": 24.0, "fresh": 120.0})
    unmeasured = {cost.name: cost.work for cost in measured_costs(per_step, steps_left, {})}
    assert unmeasured == {"a": 400, "b": 400, "fresh": 3000}, "no tenant measured: the estimates"


def test_a_resume_plans_by_the_measured_step_times(tmp_path: Path) -> None:
    """Four tenants of equal estimates resume after 2 of 10 steps; tenant-3's steps took ten times as long as the
    others': it gets a replica of its own, where the estimates alone would pair the tenants."""
    from dataclasses import replace

    from skyrl_clora.checkpoints import TenantCheckpoint
    from skyrl_clora.config.build import build_run_config
    from skyrl_clora.config.compose import compose_config
    from skyrl_clora.placement.replicas import plan_replicas

    run = build_run_config(compose_config([f"clora.output_dir={tmp_path}", "+tenants=4", "clora.replicas=2"]))
    run = replace(run, planned_steps=10)
    specs = list(run.tenants)
    seconds = {spec.name: 10.0 if spec.name == "tenant-3" else 1.0 for spec in specs}
    resume = {name: TenantCheckpoint(tmp_path, 2, 2, False, [_step(name, 1, value), _step(name, 2, value)])
              for name, value in seconds.items()}
    estimated = plan_replicas(run, specs, {name: replace(checkpoint, records=[]) for name, checkpoint in resume.items()}, 2)
    assert sorted(len(group) for group in estimated) == [2, 2]
    measured = [[spec.name for spec in group] for group in plan_replicas(run, specs, resume, 2)]
    assert sorted(measured) == [["tenant-0", "tenant-1", "tenant-2"], ["tenant-3"]]
