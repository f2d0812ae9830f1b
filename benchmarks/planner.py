"""The placement planner's makespan against the exact optimum (brute force) on random small cases, and against
the even-spread lower bound on large ones; CPU only.

Usage: python -m benchmarks.planner --cases 1000 --out planner.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from skyrl_clora.placement.planner import TenantCost, makespan, optimal_assignment, plan_assignment


def small_case(rng: random.Random) -> tuple[list[TenantCost], int, int]:
    """2-8 tenants of lognormal work (sigma 0.8: a few long experiments), 2-3 replicas, a per-replica limit of
    tenants from the least that fits to none."""
    count, replicas = rng.randint(2, 8), rng.randint(2, 3)
    capacity = rng.randint(-(-count // replicas), count)
    return [TenantCost(f"t{i}", rng.lognormvariate(0.0, 0.8)) for i in range(count)], replicas, capacity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    ratios, seconds = [], []
    for _ in range(args.cases):
        tenants, replicas, capacity = small_case(rng)
        started = time.perf_counter()
        plan = plan_assignment(tenants, replicas, capacity)
        seconds.append(time.perf_counter() - started)
        ratios.append(makespan(plan, {t.name: t.work for t in tenants}) / optimal_assignment(tenants, replicas, capacity)[0])
    large = []
    for tenants_count, replicas in ((16, 2), (32, 4), (64, 8)):
        tenants = [TenantCost(f"t{i}", rng.lognormvariate(0.0, 0.8)) for i in range(tenants_count)]
        started = time.perf_counter()
        plan = plan_assignment(tenants, replicas, tenants_count)
        bound = max(sum(t.work for t in tenants) / replicas, max(t.work for t in tenants))
        large.append({"tenants": tenants_count, "replicas": replicas, "vs_lower_bound": makespan(
            plan, {t.name: t.work for t in tenants}) / bound, "seconds": time.perf_counter() - started})
    report = {"small_cases": args.cases, "worst_vs_optimum": max(ratios), "mean_vs_optimum": statistics.mean(ratios),
              "optimal_share": sum(r <= 1 + 1e-9 for r in ratios) / len(ratios),
              "slowest_plan_s": max(seconds), "large": large}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.cases} small cases: worst {report['worst_vs_optimum']:.4f}x the optimum, mean "
          f"{report['mean_vs_optimum']:.4f}x, optimal in {100 * report['optimal_share']:.1f}%, slowest plan "
          f"{1e3 * report['slowest_plan_s']:.1f} ms")
    for row in large:
        print(f"{row['tenants']} tenants on {row['replicas']} replicas: {row['vs_lower_bound']:.4f}x the lower bound "
              f"in {row['seconds']:.2f} s")


if __name__ == "__main__":
    main()
