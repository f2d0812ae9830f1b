"""The placement planner against the exact optimum on small cases (<= 8 tenants, 2-3 replicas)."""

from __future__ import annotations

import random

import pytest

from benchmarks.planner import small_case
from skyrl_clora.placement.planner import TenantCost, makespan, optimal_assignment, pick_move, plan_assignment


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
