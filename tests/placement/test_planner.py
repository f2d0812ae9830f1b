"""The placement planner against the exact optimum on small cases (<= 8 tenants, 2-3 replicas)."""

from __future__ import annotations

import random

import pytest

from benchmarks.planner import small_case
from skyrl_clora.placement.planner import TenantCost, makespan, optimal_assignment, plan_assignment


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
