"""The placement planner's makespan against the exact optimum (brute force) on random small cases, and against
the even-spread lower bound on large ones; the pack planner's round seconds (its cost model) against the optimum
over every partition on random small cases, with and without its exact search; CPU only.

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
from skyrl_clora.trainer.pack_plan import PackCostModel, PackLoad, optimal_packs, plan_packs, round_seconds


def small_case(rng: random.Random) -> tuple[list[TenantCost], int, int]:
    """2-8 tenants of lognormal work (sigma 0.8: a few long experiments), 2-3 replicas, a per-replica limit of
    tenants from the least that fits to none."""
    count, replicas = rng.randint(2, 8), rng.randint(2, 3)
    capacity = rng.randint(-(-count // replicas), count)
    return [TenantCost(f"t{i}", rng.lognormvariate(0.0, 0.8)) for i in range(count)], replicas, capacity


def pack_case(rng: random.Random) -> tuple[list[PackLoad], int, PackCostModel]:
    """2-8 tenants, pack size 2-4. Per tenant: 1-8 prompts of 32-512 tokens x 1, 2, 4 or 8 samples; responses
    lognormal around a per-tenant median of 30-1500 tokens (sigma 0.5, at most 4096: tenants of short and of long
    answers); rank 8, 16, 32 or 64. Micro-batches of 16 rows, or an 8192- or 32768-token budget with whole
    sequences or shared prompts; a quarter of the cases take two policy mini-batches."""
    count, pack_size = rng.randint(2, 8), rng.randint(2, 4)
    loads = []
    for index in range(count):
        prompts, samples = rng.randint(1, 8), rng.choice((1, 2, 4, 8))
        median = rng.lognormvariate(5.3, 1.0)
        prompt_lens = [rng.randint(32, 512) for _ in range(prompts)]
        loads.append(PackLoad(
            f"t{index}", tuple(length for length in prompt_lens for _ in range(samples)),
            tuple(min(4096, max(1, round(rng.lognormvariate(0.0, 0.5) * min(1500.0, max(30.0, median)))))
                  for _ in range(prompts * samples)),
            tuple(f"p{p}" for p in range(prompts) for _ in range(samples)), rng.choice((8, 16, 32, 64)),
            scores=False))
    budget, shared = rng.choice(((-1, False), (8192, False), (8192, True), (32768, False), (32768, True)))
    model = PackCostModel(micro_batch_size=16, max_tokens=budget, shared_prompts=shared,
                          mini_batch_prompts=rng.choice((0, 0, 0, 2)))
    return loads, pack_size, model


def pack_report(cases: int, rng: random.Random) -> dict[str, object]:
    """The pack plan's round seconds over the optimum's on ``cases`` cases of :func:`pack_case`: the plan
    (``plan``: its exact search), what rounds too large for that search get (``repartition``: starts, exchanges,
    exact re-partitions of two or three passes; on these small rounds two or three passes are often all of
    them; ``repartition_over_3_passes``: the cases where its plan has more than three passes, so that no
    re-partition spans the round), the starts and exchanges alone (``exchanges``), and member order cut into passes (the lockstep
    policy before the plan), for scale."""
    ratios: dict[str, list[float]] = {"plan": [], "repartition": [], "repartition_over_3_passes": [], "exchanges": [],
                                      "member_order": []}
    seconds = []
    for _ in range(cases):
        loads, pack_size, model = pack_case(rng)
        best, _ = optimal_packs(loads, pack_size, model)
        started = time.perf_counter()
        plan = plan_packs(loads, pack_size, model)
        seconds.append(time.perf_counter() - started)
        names = [load.name for load in loads]
        member_order = [names[first : first + pack_size] for first in range(0, len(names), pack_size)]
        repartition = plan_packs(loads, pack_size, model, "repartition")
        for key, passes in (("plan", plan), ("repartition", repartition),
                            ("exchanges", plan_packs(loads, pack_size, model, "exchanges")),
                            ("member_order", member_order)):
            ratios[key].append(round_seconds(passes, loads, model) / best)
        if len(repartition) > 3:  # no re-partition spans the whole round
            ratios["repartition_over_3_passes"].append(ratios["repartition"][-1])
    return {key: {"worst_vs_optimum": max(values), "mean_vs_optimum": statistics.mean(values),
                  "optimal_share": sum(r <= 1 + 1e-9 for r in values) / len(values), "cases": len(values)}
            for key, values in ratios.items() if values} | {
        "cases": cases, "slowest_plan_s": max(seconds)}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--pack-cases", type=int, default=300)
    parser.add_argument("--large", type=int, nargs="+", default=[16, 32, 64], metavar="N",
                        help="the large cases' tenant counts (multiples of 8; one replica per 8 tenants)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cases < 1 or args.pack_cases < 1:
        parser.error("--cases and --pack-cases must be at least 1")
    if any(count < 8 or count % 8 for count in args.large):
        parser.error("--large: give multiples of 8")
    rng = random.Random(args.seed)
    ratios, seconds = [], []
    for _ in range(args.cases):
        tenants, replicas, capacity = small_case(rng)
        started = time.perf_counter()
        plan = plan_assignment(tenants, replicas, capacity)
        seconds.append(time.perf_counter() - started)
        ratios.append(makespan(plan, {t.name: t.work for t in tenants}) / optimal_assignment(tenants, replicas, capacity)[0])
    large = []
    for tenants_count, replicas in ((count, count // 8) for count in args.large):
        tenants = [TenantCost(f"t{i}", rng.lognormvariate(0.0, 0.8)) for i in range(tenants_count)]
        started = time.perf_counter()
        plan = plan_assignment(tenants, replicas, tenants_count)
        bound = max(sum(t.work for t in tenants) / replicas, max(t.work for t in tenants))
        large.append({"tenants": tenants_count, "replicas": replicas, "vs_lower_bound": makespan(
            plan, {t.name: t.work for t in tenants}) / bound, "seconds": time.perf_counter() - started})
    report = {"small_cases": args.cases, "worst_vs_optimum": max(ratios), "mean_vs_optimum": statistics.mean(ratios),
              "optimal_share": sum(r <= 1 + 1e-9 for r in ratios) / len(ratios),
              "slowest_plan_s": max(seconds), "large": large}
    report["packs"] = pack_report(args.pack_cases, rng)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.cases} small cases: worst {report['worst_vs_optimum']:.4f}x the optimum, mean "
          f"{report['mean_vs_optimum']:.4f}x, optimal in {100 * report['optimal_share']:.1f}%, slowest plan "
          f"{1e3 * report['slowest_plan_s']:.1f} ms")
    for row in large:
        print(f"{row['tenants']} tenants on {row['replicas']} replicas: {row['vs_lower_bound']:.4f}x the lower bound "
              f"in {row['seconds']:.2f} s")
    packs = report["packs"]
    for key in ("plan", "repartition", "repartition_over_3_passes", "exchanges", "member_order"):
        if key not in packs:
            continue
        print(f"packs, {key}: worst {packs[key]['worst_vs_optimum']:.4f}x the optimum over {packs[key]['cases']} cases, mean "
              f"{packs[key]['mean_vs_optimum']:.4f}x, optimal in {100 * packs[key]['optimal_share']:.1f}%")
    print(f"packs: slowest plan {1e3 * packs['slowest_plan_s']:.1f} ms")


if __name__ == "__main__":
    main()
