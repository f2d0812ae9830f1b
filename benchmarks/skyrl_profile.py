"""Where a tenant step's seconds go on backend=skyrl (SkyRL's policy workers, its FSDP2 worker by default, beside the
embedded engine on the same GPU) against backend=embedded, the two runs side by side in one call.

1. Unless ``--model-path`` names a model folder, writes a ``--shape`` model (default Qwen3-1.7B) with random weights,
   the tokenizer of ``--tokenizer`` and Qwen3's vocabulary (``--vocab-size``) into a scratch folder, with
   ``python -m benchmarks.common`` in its own process (this one holds no GPU memory while the runs go).
2. Runs ``python -m skyrl_clora.main`` once per ``--runs`` entry (default: embedded, then skyrl: the second finds the
   engine's Triton kernels compiled and cached), each with ``preset=demo +tenants=<--tenants>
   trainer.max_training_steps=<--steps>``, the model and the extra arguments (Hydra overrides for both runs); skyrl adds
   ``backend.strategy=<--strategy> backend.inference_backend=embedded trainer.flash_attn=false
   trainer.remove_microbatch_padding=false``. A run writes its outputs (adapters, checkpoints) in the scratch folder;
   its log, summary.json and metrics.jsonl are copied to ``<--out>/<run>/``.
3. Reads each run's summary.json and metrics.jsonl, writes everything to ``<--out>/skyrl_profile.json`` and prints: per
   run the wall, the :data:`SUMMARY_SECONDS` of its summary (cold start and, on skyrl, the tenants' registrations),
   experiments/hour with and without (``warm``) the cold start, skyrl's cold start by part
   (``cold_start_parts_seconds``), the FSDP2 worker's allocator counters (``worker_allocator``) and skyrl/embedded;
   then per step field the median over tenant steps, the sum over them and that sum over the run's wall. The step
   fields: the tenant loop's ``rollout_s``, ``train_s`` and ``sync_s``, and on skyrl the update's parts
   (``skyrl_clora.backends.skyrl.backend.STEP_PHASES``, ``train/<phase>``) with ``train other``, ``train_s`` less its
   parts. Tenants roll out at the same time, so a rollout sum over the wall can pass 100%
   (tenant-seconds per second); skyrl's updates and syncs take turns on one worker group, so theirs is the share of the
   wall that group spends on each part. ``outside steps`` is per tenant the wall less the cold start, its registration
   and its steps (evaluations, export, checkpoints), the median over tenants.

Usage (GPU): python -m benchmarks.skyrl_profile --tokenizer <model dir with a chat template> --out $OUT/skyrl_profile
Smoke (CPU): python -m benchmarks.skyrl_profile --model-path <tiny base> --strategy embedded --steps 1 --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import QWEN3_VOCAB, SHAPES
from skyrl_clora.backends.skyrl.backend import STEP_PHASES

TRAIN_PARTS = [f"train/{phase}" for phase in STEP_PHASES if phase != "lock_wait_s"]  # the parts inside train_s
FIELDS = ["rollout_s", "train/lock_wait_s", "train_s", *TRAIN_PARTS, "train other", "sync_s"]
# The summaries' seconds outside the steps: the stack's build (a list: one per build), each tenant's registration (a
# mapping by tenant; skyrl only) and the base model's one-time build (outside the wall).
SUMMARY_SECONDS = ("cold_start_seconds", "register_seconds", "base_model_seconds")
RUNS = ("embedded", "skyrl")


def run_overrides(run: str, args: argparse.Namespace, model_path: Path, output_dir: Path,
                  extra: list[str]) -> list[str]:
    """The ``skyrl_clora.main`` overrides of ``run`` (a name of :data:`RUNS`), its outputs in ``output_dir``."""
    backend = (["backend=skyrl", f"backend.strategy={args.strategy}", "backend.inference_backend=embedded",
                "trainer.flash_attn=false", "trainer.remove_microbatch_padding=false"]
               if run == "skyrl" else ["backend=embedded"])
    return [*backend, f"+tenants={args.tenants}", f"trainer.max_training_steps={args.steps}",
            f"trainer.policy.model.path={model_path}", "preset=demo", "clora.progress=false",
            f"clora.output_dir={output_dir}", *extra]


def run_main(run: str, overrides: list[str], output_dir: Path, out: Path) -> None:
    """``python -m skyrl_clora.main overrides`` (its outputs in ``output_dir``); its log, summary.json and metrics.jsonl
    into ``out/<run>/``; on failure the log's tail and exit status 1."""
    folder = out / run
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "skyrl_clora.main", *overrides]
    print("$", " ".join(command), flush=True)
    with (folder / "run.log").open("w") as log:
        status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if status != 0:
        tail = (folder / "run.log").read_text().splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        print(f"error: the {run} run exited with status {status}; its log: {folder / 'run.log'}", file=sys.stderr)
        sys.exit(1)
    for name in ("summary.json", "metrics.jsonl"):
        shutil.copy(output_dir / name, folder / name)


def step_values(record: dict[str, Any]) -> dict[str, float]:
    """The :data:`FIELDS` a step record holds (``train other``: ``train_s`` less the update's parts, where it has
    them)."""
    values = {field: float(record[field]) for field in FIELDS if field in record}
    if all(part in record for part in TRAIN_PARTS):
        values["train other"] = record["train_s"] - sum(record[part] for part in TRAIN_PARTS)
    return values


def profile(folder: Path) -> dict[str, Any]:
    """A run's figures from its ``summary.json`` and ``metrics.jsonl`` in ``folder`` (see the module docstring)."""
    summary = json.loads((folder / "summary.json").read_text())
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if record.get("event") == "step"]
    wall = summary["wall_seconds"]
    seconds = {key: _total(summary[key]) for key in SUMMARY_SECONDS if key in summary}
    per_step = [step_values(record) for record in steps]
    fields = {}
    for field in FIELDS:
        values = [step[field] for step in per_step if field in step]
        if values:
            fields[field] = {"median": statistics.median(values), "sum": sum(values),
                             "share_of_wall": sum(values) / wall}
    registered = summary.get("register_seconds", {})
    in_steps: dict[str, float] = {}  # by tenant: the seconds its steps took, lock waits included
    for record in steps:
        in_steps[record["tenant"]] = in_steps.get(record["tenant"], 0.0) + sum(
            record.get(key, 0.0) for key in ("rollout_s", "train/lock_wait_s", "train_s", "sync_s"))
    outside = [wall - seconds.get("cold_start_seconds", 0.0) - registered.get(tenant, 0.0) - total
               for tenant, total in in_steps.items()]
    warm = wall - seconds.get("cold_start_seconds", 0.0)
    return {"strategy": summary.get("strategy"), "tenants": summary["tenants"],
            "steps": len(steps), "wall_seconds": wall, "experiments_per_hour": summary["experiments_per_hour"],
            "experiments_per_hour_warm": summary["tenants"] * 3600 / warm,
            "seconds": seconds, "summary_seconds": {key: summary[key] for key in SUMMARY_SECONDS if key in summary},
            "cold_start_parts": summary.get("cold_start_parts_seconds", {}),
            "worker_allocator": summary.get("worker_allocator", {}),
            "fields": fields,
            "outside_steps_seconds": statistics.median(outside) if outside else None,
            "step_records": [{"tenant": r["tenant"], "step": r["step"], **v} for r, v in zip(steps, per_step)]}


def _total(value: Any) -> float:
    """A summary's seconds as one number: a list's or a mapping's sum."""
    if isinstance(value, dict):
        return float(sum(value.values()))
    return float(sum(value)) if isinstance(value, list) else float(value)


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """The runs' table, then the step fields' (module docstring); ``results``: :func:`profile`'s by run."""
    names = list(results)
    print(f"{'run':>9} {'strategy':>9} {'tenants':>7} {'steps':>5} {'wall s':>8} {'exp/h':>8} {'warm exp/h':>10} "
          + " ".join(f"{key.removesuffix('_seconds'):>14}" for key in SUMMARY_SECONDS) + f" {'outside s':>9}")
    for name in names:
        row = results[name]
        print(f"{name:>9} {row['strategy'] or '-':>9} {row['tenants']:>7} {row['steps']:>5} "
              f"{row['wall_seconds']:>8.1f} {row['experiments_per_hour']:>8.1f} {row['experiments_per_hour_warm']:>10.1f} "
              + " ".join(f"{_number(row['seconds'].get(key)):>14}" for key in SUMMARY_SECONDS)
              + f" {_number(row['outside_steps_seconds']):>9}")
    for name in names:
        if results[name]["cold_start_parts"]:
            print(f"{name} cold start: " + ", ".join(f"{part} {value:.2f} s"
                                                     for part, value in results[name]["cold_start_parts"].items()))
        if results[name]["worker_allocator"]:
            print(f"{name} worker allocator: " + ", ".join(f"{key} {value}"
                                                           for key, value in results[name]["worker_allocator"].items()))
    if {"skyrl", "embedded"} <= set(results):
        skyrl, embedded = results["skyrl"], results["embedded"]
        print(f"skyrl/embedded: wall {skyrl['wall_seconds'] / embedded['wall_seconds']:.2f}x, experiments/hour "
              f"{skyrl['experiments_per_hour'] / embedded['experiments_per_hour']:.3f}x, without the cold starts "
              f"{skyrl['experiments_per_hour_warm'] / embedded['experiments_per_hour_warm']:.3f}x")
    print(f"{'step field':>24} " + " ".join(f"{name + ' ' + stat:>17}" for name in names
                                           for stat in ("median", "sum", "% wall")))
    for field in FIELDS:
        cells = []
        for name in names:
            stats = results[name]["fields"].get(field)
            cells += ([f"{stats['median']:>17.3f}", f"{stats['sum']:>17.2f}", f"{stats['share_of_wall']:>17.1%}"]
                      if stats else [f"{'-':>17}"] * 3)
        print(f"{field:>24} " + " ".join(cells))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``; unknown ones: overrides of every run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=next(line for line in __doc__.splitlines() if line.startswith("Usage")))
    parser.add_argument("--model-path", type=Path, help="a model folder to run (default: write a random --shape one)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--tokenizer", type=Path, help="the model folder whose tokenizer the written model gets")
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB, help="the written model's vocabulary")
    parser.add_argument("--strategy", default="fsdp2", help="backend.strategy of the skyrl run (CPU: embedded)")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="the runs, in this order")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args, extra = parser.parse_known_args(argv)
    if args.model_path is None and args.tokenizer is None:
        parser.error("give --model-path, or --tokenizer to write a random --shape model")
    args.out.mkdir(parents=True, exist_ok=True)
    commands = {}
    with tempfile.TemporaryDirectory() as folder:  # the model and the runs' outputs: GBs that $OUT need not carry
        scratch = Path(folder)
        model_path = args.model_path
        if model_path is None:
            model_path = scratch / f"model-{args.shape}"
            subprocess.run([sys.executable, "-m", "benchmarks.common", "--shape", args.shape, "--tokenizer-from",
                            str(args.tokenizer), "--vocab-size", str(args.vocab_size), "--out", str(model_path)],
                           check=True)
        results = {}
        for run in args.runs:
            commands[run] = run_overrides(run, args, model_path, scratch / run, extra)
            run_main(run, commands[run], scratch / run, args.out)
            results[run] = profile(args.out / run)
    report = {"model": str(args.model_path) if args.model_path else f"random {args.shape}, vocab {args.vocab_size}",
              "strategy": args.strategy, "tenants": args.tenants, "steps": args.steps, "overrides": extra,
              "commands": commands, "runs": results}
    (args.out / "skyrl_profile.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(results)


if __name__ == "__main__":
    main()
