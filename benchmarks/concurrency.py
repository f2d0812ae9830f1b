"""Concurrent vs serial experiment throughput on the same workload, measured side by side in one run.

Runs ``python -m skyrl_clora.main`` twice with the same overrides, once with ``clora.mode=concurrent`` and
once with ``clora.mode=serial`` (each tenant paying its own cold start: model load and engine build),
then prints one table: wall time, experiments per hour, mean per-tenant step time (rollout + train + sync),
mean final accuracy and its standard deviation over tenants; then the throughput ratio, the step-time ratio
(concurrent vs serial, i.e. N tenants vs one at a time) and whether concurrent mode's mean accuracy is within
one std of serial's.

Usage: python -m benchmarks.concurrency --out outputs/bench [extra Hydra overrides, e.g. +tenants=8 clora.device=cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run_mode(mode: str, out: Path, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "skyrl_clora.main", *overrides, f"clora.mode={mode}", f"clora.output_dir={out / mode}"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads((out / mode / "summary.json").read_text())


def mean_step_seconds(metrics_path: Path) -> float:
    """Mean per-tenant RL step time (rollout + train + sync) over the run's step records."""
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    steps = [r for r in steps if r.get("event") == "step"]
    return statistics.mean(r["rollout_s"] + r["train_s"] + r["sync_s"] for r in steps) if steps else float("nan")


def final_accuracies(summary: dict) -> list[float]:
    return [row["accuracy_final"] for row in summary["per_tenant"] if row["accuracy_final"] is not None]


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_concurrency"))
    args, overrides = parser.parse_known_args(argv)
    results = {mode: run_mode(mode, args.out, overrides) for mode in ("concurrent", "serial")}
    rows = []
    for mode, summary in results.items():
        accuracies = final_accuracies(summary)
        starts = [row["accuracy_start"] for row in summary["per_tenant"] if row["accuracy_start"] is not None]
        rows.append({
            "mode": mode, "tenants": summary["tenants"], "steps": summary["steps"],
            "wall_s": summary["wall_seconds"], "cold_start_s": sum(summary["cold_start_seconds"]),
            "experiments_per_hour": summary["experiments_per_hour"],
            "acc_start_mean": statistics.mean(starts) if starts else None,
            "acc_final_mean": statistics.mean(accuracies) if accuracies else None,
            "acc_final_std": statistics.pstdev(accuracies) if len(accuracies) > 1 else 0.0,
            "step_s": mean_step_seconds(args.out / mode / "metrics.jsonl"),
        })
    concurrent, serial = rows
    ratio = concurrent["experiments_per_hour"] / serial["experiments_per_hour"]
    no_regression = abs(concurrent["acc_final_mean"] - serial["acc_final_mean"]) <= serial["acc_final_std"]
    step_ratio = concurrent["step_s"] / serial["step_s"]
    report = {"rows": rows, "throughput_ratio": ratio, "step_time_ratio": step_ratio, "accuracy_within_one_std": no_regression,
              "base_model_seconds": results["concurrent"]["base_model_seconds"], "overrides": overrides}
    (args.out / "bench_concurrency.json").write_text(json.dumps(report, indent=2) + "\n")
    header = (f"{'mode':>10} {'tenants':>7} {'steps':>5} {'wall_s':>8} {'cold_s':>7} {'exp/h':>8} {'step_s':>7} {'acc@0':>6} "
              f"{'acc_final':>9} {'std':>6}")
    print(header)
    for row in rows:
        print(f"{row['mode']:>10} {row['tenants']:>7} {row['steps']:>5} {row['wall_s']:>8.1f} {row['cold_start_s']:>7.1f} "
              f"{row['experiments_per_hour']:>8.1f} {row['step_s']:>7.2f} {row['acc_start_mean']:>6.3f} {row['acc_final_mean']:>9.3f} "
              f"{row['acc_final_std']:>6.3f}")
    print(f"concurrent/serial experiment throughput: {ratio:.2f}x; per-tenant step time {step_ratio:.2f}x of serial's; "
          f"concurrent mean final accuracy within one std of serial: {no_regression}")


if __name__ == "__main__":
    main()
