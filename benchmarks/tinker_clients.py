"""N Tinker clients running a recipe's RL experiments against one Tinker server (``clora`` backend), at once and one
after another, beside ``python -m skyrl_clora.main +tenants=N`` in both modes on the same workload, in one run.

Workload: the main job's (the GSM8K-agentic recipe on the tiny base unless overrides say otherwise) with the
given Hydra overrides, ``+tenants=<--tenants>`` added. Four runs, in this order:

1. ``tinker concurrent``: ``python -m skyrl_clora.tinker.server`` starts (its cold start: process start to its
   first answered sample of one base-model token: imports, model load, engine build), then every tenant runs as a Tinker client of it at once
   (:func:`skyrl_clora.tinker.recipe_clients.run_recipe_clients`, in this process);
2. ``tinker serial``: the same clients one after another on that server, which stays up (warm);
3. ``main concurrent`` / ``main serial``: ``python -m skyrl_clora.main`` with ``clora.mode=concurrent`` /
   ``serial`` (serial: each tenant pays its own cold start).

Experiments per hour count each run's wall; the Tinker runs' walls include the server's cold start once. Because
main's serial experiments each pay a cold start and the Tinker server's are warm, the table also gives the Tinker
clients' ratio against a serial run paying one server cold start per experiment (``serial, a cold start each``: the
serial clients' wall plus ``N`` times the measured cold start; derived, not run), and the clients' ratio on the warm
server (``server warm``: the cold start left out of both walls). Per run: wall, experiments/hour,
the mean per-tenant step (rollout + train + sync), the mean final evaluation accuracy and its std over tenants; per
Tinker run, the CPU seconds per wall second of the clients' process, the server's API process and its engine.
Everything goes to ``<--out>/tinker_clients.json``; each run's summary.json and metrics.jsonl under ``<--out>/<run>/``,
the server's log at ``<--out>/server.log`` (the runs' adapters, checkpoints and the server's state go to a scratch
folder, removed at the end).

Usage (GPU): python -m benchmarks.tinker_clients --tenants 8 --out $OUT/tinker [Hydra overrides]
On the CPU add ``--device cpu`` (and small overrides): its figures say only that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import tinker
from benchmarks.concurrency import final_accuracies, run_mode
from tinker import types

from skyrl_clora.base_model import resolve_model_path
from skyrl_clora.metrics import summarize_pool
from skyrl_clora.run_shell import prepare
from skyrl_clora.tinker.recipe_clients import run_recipe_clients

START_TIMEOUT_S = 600.0


def start_server(model: str, tenants: int, rows: int, rank: int, device: str, out: Path,
                 work: Path) -> tuple[subprocess.Popen, str, str, float]:
    """The Tinker server on ``model`` sized for ``tenants`` models of rank ``rank`` and ``rows`` sequences at once, its
    log in ``out`` and its database and checkpoints in ``work``; returns the process, its URL, its key and its cold
    start (seconds to its first answered sample)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    key = "tml-" + secrets.token_hex(16)
    config = {"max_lora_adapters": tenants, "max_lora_rank": rank, "max_rows": rows, "max_sequence_length": 1024,
              "overrides": [f"clora.device={device}"]}
    command = [sys.executable, "-m", "skyrl_clora.tinker.server", "--base-model", model, "--port", str(port),
               "--workdir", str(work / "server"), "--api-key", key, "--backend-config", json.dumps(config)]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    log = (out / "server.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TINKER_TELEMETRY": "0"})
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.perf_counter() - started > START_TIMEOUT_S:
            print((out / "server.log").read_text()[-3000:], file=sys.stderr)
            raise SystemExit(f"error: the Tinker server did not start; its log: {out / 'server.log'}")
        time.sleep(0.2)
    with tinker.ServiceClient(base_url=url, api_key=key) as service:  # ready once the engine answers a sample
        sampler = service.create_sampling_client(base_model=model).result()
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1)).result()
    return process, url, key, time.perf_counter() - started


def run_clients(overrides: list[str], mode: str, out: Path, work: Path, url: str, key: str,
                server: psutil.Process) -> tuple[dict[str, Any], dict[str, float]]:
    """The run's tenants as Tinker clients in ``mode`` (outputs in ``work``) against ``server``; its summary
    (:func:`keep`) and the CPU seconds its processes spent over its pool (:func:`cpu_seconds`), with that wall
    (``wall``)."""
    name = f"tinker-{mode}"
    prepared = prepare([*overrides, f"clora.mode={mode}", f"clora.output_dir={work / name}"])
    run = prepared.run
    model = resolve_model_path(run)
    before, started = cpu_seconds(server), time.perf_counter()
    summarize_pool(run, lambda: run_recipe_clients(run, prepared.sources, prepared.resume, url, key, model),
                   prepared.base_model_s)
    after, wall = cpu_seconds(server), time.perf_counter() - started
    return keep(work / name, out / name), {"wall": wall, **{part: after[part] - before[part] for part in after}}


def cpu_seconds(server: psutil.Process) -> dict[str, float]:
    """CPU seconds (user + system, all threads) so far of this process (the clients), of the server's API process
    and of its engine subprocess(es)."""
    def spent(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    return {"clients": spent(psutil.Process()), "server_api": spent(server),
            "server_engine": sum(spent(child) for child in server.children(recursive=True))}


def run_main(overrides: list[str], mode: str, out: Path, work: Path) -> dict[str, Any]:
    """``python -m skyrl_clora.main`` in ``mode`` (:func:`benchmarks.concurrency.run_mode`, outputs in ``work``); its
    summary (:func:`keep`)."""
    run_mode(mode, work / "main", overrides)
    return keep(work / "main" / mode, out / f"main-{mode}")


def keep(run_dir: Path, folder: Path) -> dict[str, Any]:
    """Copies a run's summary.json and metrics.jsonl from ``run_dir`` into ``folder``; returns the summary."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "metrics.jsonl"):
        shutil.copy(run_dir / name, folder / name)
    return json.loads((folder / "summary.json").read_text())


def row(name: str, summary: dict[str, Any], folder: Path, extra_s: float = 0.0) -> dict[str, Any]:
    """A table row of a run's ``summary`` (its records in ``folder``), ``extra_s`` added to its wall."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "step"]
    finals = final_accuracies(summary)
    wall = summary["wall_seconds"] + extra_s
    parts = {f"{part}_s": statistics.mean(r[f"{part}_s"] for r in steps) for part in ("rollout", "train", "sync")}
    return {"run": name, "tenants": summary["tenants"], "wall_s": wall,
            "experiments_per_hour": summary["tenants"] * 3600 / wall, "step_s": sum(parts.values()), **parts,
            "acc_final_mean": statistics.mean(finals) if finals else None,
            "acc_final_std": statistics.pstdev(finals) if len(finals) > 1 else 0.0}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_tinker"))
    args, extra = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_tinker_"))  # the runs' adapters, checkpoints and server state
    overrides = [f"+tenants={args.tenants}", "clora.progress=false", f"clora.device={args.device}", *extra]
    probe = prepare([*overrides, f"clora.output_dir={work / 'probe'}"]).run  # the model and sizes
    rows = args.tenants * probe.recipe.prompts_per_step * max(spec.samples_per_prompt for spec in probe.tenants)
    rank = max(spec.rank for spec in probe.tenants)
    server, url, key, cold_start = start_server(resolve_model_path(probe), args.tenants, rows, rank, args.device,
                                                args.out, work)
    try:
        summaries, cpu = {}, {}
        for mode in ("concurrent", "serial"):
            summaries[f"tinker {mode}"], cpu[f"tinker {mode}"] = run_clients(overrides, mode, args.out, work, url,
                                                                            key, psutil.Process(server.pid))
    finally:
        server.terminate()
        server.wait(timeout=120)
    summaries |= {"main concurrent": run_main(overrides, "concurrent", args.out, work),
                  "main serial": run_main(overrides, "serial", args.out, work)}
    shutil.rmtree(work)
    folders = {"tinker concurrent": "tinker-concurrent", "tinker serial": "tinker-serial",
               "main concurrent": "main-concurrent", "main serial": "main-serial"}
    rows_out = [row(name, summary, args.out / folders[name], cold_start if name.startswith("tinker") else 0.0)
                for name, summary in summaries.items()]
    rows_out.append(row("tinker serial, a cold start each", summaries["tinker serial"], args.out / "tinker-serial",
                        args.tenants * cold_start))
    by = {r["run"]: r for r in rows_out}
    ratios = {
        "tinker concurrent / tinker serial": by["tinker concurrent"]["experiments_per_hour"]
        / by["tinker serial"]["experiments_per_hour"],
        "tinker concurrent / tinker serial, server warm": summaries["tinker serial"]["wall_seconds"]
        / summaries["tinker concurrent"]["wall_seconds"],
        "tinker concurrent / tinker serial, a cold start each": by["tinker concurrent"]["experiments_per_hour"]
        / by["tinker serial, a cold start each"]["experiments_per_hour"],
        "main concurrent / main serial": by["main concurrent"]["experiments_per_hour"]
        / by["main serial"]["experiments_per_hour"],
        "tinker concurrent / main concurrent": by["tinker concurrent"]["experiments_per_hour"]
        / by["main concurrent"]["experiments_per_hour"],
    }
    report = {"overrides": overrides, "server_cold_start_s": cold_start, "rows": rows_out, "ratios": ratios,
              "cpu_seconds": cpu}
    (args.out / "tinker_clients.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"Tinker server cold start {cold_start:.1f} s")
    print(f"{'run':>34} {'wall_s':>8} {'exp/h':>8} {'step_s':>7} {'rollout':>7} {'train':>6} {'sync':>6} "
          f"{'acc_final':>9} {'std':>6}")
    for r in rows_out:
        accuracy = f"{r['acc_final_mean']:>9.3f}" if r["acc_final_mean"] is not None else f"{'-':>9}"
        print(f"{r['run']:>34} {r['wall_s']:>8.1f} {r['experiments_per_hour']:>8.1f} {r['step_s']:>7.2f} "
              f"{r['rollout_s']:>7.2f} {r['train_s']:>6.2f} {r['sync_s']:>6.2f} {accuracy} {r['acc_final_std']:>6.3f}")
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    for name, parts in cpu.items():
        print(f"{name}: CPU seconds per wall second: " + ", ".join(
            f"{part} {seconds / parts['wall']:.2f}" for part, seconds in parts.items() if part != "wall"))


if __name__ == "__main__":
    main()
