"""Per-tenant metrics: JSONL records, a live status line, the experiment trackers, the final summary table and
reward-curve plot, and the run's timing and summary written once for every backend.

Trackers: each tenant's metrics in the experiment trackers SkyRL users follow, through SkyRL's own ``Tracking``.

``trainer.logger`` lists the backends (``console``, ``tensorboard``, ``wandb``) of project
``trainer.project_name``. TensorBoard and the console get one tracker per tenant, a run named
``<trainer.run_name>/<tenant>`` (TensorBoard's under ``<output_dir>/tensorboard/<tenant>/``), so that the
tenants' curves of one metric overlay. wandb keeps one run per process (its ``wandb.log`` acts on the global
run), so the run ``<trainer.run_name>`` holds every tenant, each in its own namespace ``<tenant>/...`` with its
own step axis ``<tenant>/step`` (tenants reach their steps in any order); ``WANDB_MODE=offline`` writes it
under ``<output_dir>/wandb`` without a network. Each step record is logged at its RL step with its numeric
values under their own names (``reward_mean``, ``train/policy_loss``, ...), each evaluation's SkyRL metrics under
their SkyRL names (``eval/all/avg_score``, ``eval/all/pass_at_<n>``, ...) and its other values as ``eval/<name>``
(``eval/accuracy``). Records carried over from checkpoints on resume were logged by the run that made them.
"""

from __future__ import annotations

import contextlib
import json
import netrc
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TextIO
from urllib.parse import urlparse

from skyrl_clora.checkpoints import run_tenants
from skyrl_clora.config.schema import ConfigError, RunConfig

# SkyRL's tensorboard adapter reads its folder from this variable when it is built.
_TENSORBOARD_DIR = "TENSORBOARD_DIR"


def check_trackers(run: RunConfig) -> None:
    """Refuses, before anything is loaded, a ``trainer.logger`` with wandb (SkyRL's default) that wandb could not start:
    no ``WANDB_API_KEY``, no netrc entry for the wandb host (``WANDB_BASE_URL``'s, else api.wandb.ai) and a
    ``WANDB_MODE`` other than offline or disabled."""
    if "wandb" not in run.trainer.logger:
        return
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    with contextlib.suppress(OSError, netrc.NetrcParseError):
        if netrc.netrc().authenticators(host):
            return
    raise ConfigError("trainer.logger includes wandb (SkyRL's default) but wandb has no API key: run `wandb login`, set "
                      "WANDB_API_KEY or WANDB_MODE=offline, or pass trainer.logger=[console]")


class TenantTrackers:
    """The run's trackers, built for each tenant at its first record (see the module docstring)."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.run_name = run.trainer.run_name or run.output_dir.resolve().name
        self._trackers: dict[str, list[Any]] = {}
        self._wandb: Any = None
        self._wandb_axes: set[str] = set()
        self._lock = threading.Lock()

    def log(self, record: dict[str, Any]) -> None:
        """Logs a ``step`` or ``eval`` record to its tenant's trackers (other events are not metrics)."""
        event = record.get("event")
        if event not in ("step", "eval"):
            return
        values = {key: float(value) for key, value in record.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
        if event == "eval":
            values = {key if key.startswith("eval/") else f"eval/{key}": value for key, value in values.items()}
        tenant = record["tenant"]
        with self._lock:
            for tracker in self._for(tenant):
                tracker.log(values, step=record["step"], commit=True)
            if "wandb" in self.run.trainer.logger:
                self._wandb_log(tenant, values, record["step"])

    def close(self) -> None:
        with self._lock:
            for tracker in [t for trackers in self._trackers.values() for t in trackers] + [self._wandb]:
                if tracker is not None:
                    tracker.finish()
            self._trackers.clear()
            self._wandb = None

    def _for(self, tenant: str) -> list[Any]:
        if tenant not in self._trackers:
            self._trackers[tenant] = [self._build(tenant, backend) for backend in self.run.trainer.logger
                                      if backend != "wandb"]
        return self._trackers[tenant]

    def _wandb_log(self, tenant: str, values: dict[str, float], step: int) -> None:
        """Logs through the wandb module the shared Tracking holds, on the tenant's own step axis."""
        from skyrl.train.utils.tracking import Tracking

        if self._wandb is None:
            with _environment("WANDB_DIR", str(self.run.output_dir)):
                self._wandb = Tracking(self.run.trainer.project_name, self.run_name, backend="wandb",
                                       config=self.run.identity)
        wandb = self._wandb.logger
        if tenant not in self._wandb_axes:
            wandb.define_metric(f"{tenant}/step")
            wandb.define_metric(f"{tenant}/*", step_metric=f"{tenant}/step")
            self._wandb_axes.add(tenant)
        wandb.log({f"{tenant}/step": step, **{f"{tenant}/{key}": value for key, value in values.items()}})

    def _build(self, tenant: str, backend: str) -> Any:
        from skyrl.train.utils.tracking import Tracking

        name = f"{self.run_name}/{tenant}"
        if backend == "tensorboard":
            with _environment(_TENSORBOARD_DIR, str(self.run.output_dir / "tensorboard" / tenant)):
                return Tracking(self.run.trainer.project_name, name, backend="tensorboard")
        return Tracking(self.run.trainer.project_name, name, backend=backend)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """Within: environment variable ``name`` set to ``value`` (SkyRL's trackers read their folders from it)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name)
        else:
            os.environ[name] = previous


class MetricsLog:
    """Writes one JSON object per event to ``metrics.jsonl`` (thread-safe) and keeps them in memory. The file
    starts with ``resumed`` (the records a resumed run's checkpoints carry), the new events follow, each also
    logged to ``trackers`` when given. With ``progress``, a status line per event goes to ``stream``: on a
    terminal each tenant's line is updated in place, elsewhere the lines follow one another."""

    def __init__(self, path: Path, progress: bool, resumed: list[dict[str, Any]] | None = None,
                 trackers: TenantTrackers | None = None, stream: TextIO = sys.stderr) -> None:
        self.path = path
        self.trackers = trackers
        self.records: list[dict[str, Any]] = list(resumed or [])
        self.progress = progress
        self.stream = stream
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._lines: dict[str, str] = {}  # per tenant, its status line on a terminal
        self._file = path.open("w")
        for record in self.records:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
            if self.trackers is not None:
                self.trackers.log(record)
            if self.progress and record.get("event") in ("step", "eval", "failed", "stopped"):
                self._show(record["tenant"], self._status_line(record))

    def extend_resumed(self, records: list[dict[str, Any]]) -> None:
        """Appends the records a tenant resumed from a checkpoint carries (as ``resumed`` are at the start: not
        logged to the trackers nor shown, which had them when they were first written)."""
        with self._lock:
            self.records.extend(records)
            self._file.write("".join(json.dumps(record, sort_keys=True) + "\n" for record in records))
            self._file.flush()

    def forget(self, tenant: str) -> None:
        """Drops every record of ``tenant`` from the log and its file (a tenant that moved to another replica,
        whose log has them from then on)."""
        with self._lock:
            self.records = [record for record in self.records if record.get("tenant") != tenant]
            self._file.seek(0)
            self._file.truncate()
            self._file.write("".join(json.dumps(record, sort_keys=True) + "\n" for record in self.records))
            self._file.flush()

    def _show(self, tenant: str, line: str) -> None:
        """On a terminal, one line per tenant, rewritten in place (the block is redrawn under the cursor); else
        the line is appended."""
        if not self.stream.isatty():
            self.stream.write(line + "\n")
        else:
            up = f"\x1b[{len(self._lines)}F" if self._lines else ""
            self._lines[tenant] = line
            self.stream.write(up + "".join(f"\x1b[2K{text}\n" for text in self._lines.values()))
        self.stream.flush()

    def _status_line(self, record: dict[str, Any]) -> str:
        elapsed = time.perf_counter() - self.started
        tenant = record["tenant"]
        if record["event"] == "failed":
            return f"[{elapsed:7.1f}s] {tenant} FAILED: {record['error']}"
        if record["event"] == "stopped":
            return f"[{elapsed:7.1f}s] {tenant} stopped after step {record['step']} (checkpointed; the same command resumes)"
        if record["event"] == "eval":
            return f"[{elapsed:7.1f}s] {tenant} eval@{record['step']}: accuracy {record['accuracy']:.2f}"
        return (
            f"[{elapsed:7.1f}s] {tenant} step {record['step']}: reward {record['reward_mean']:.2f} "
            f"rollout {record['rollout_s']:.1f}s train {record['train_s']:.1f}s sync {record['sync_s']:.2f}s"
        )

    @classmethod
    def for_run(cls, run: RunConfig, resumed: list[dict[str, Any]]) -> MetricsLog:
        """The log of ``run``: ``<output_dir>/metrics.jsonl`` after the ``resumed`` records, the trackers that
        ``trainer.logger`` names, the status lines that ``clora.progress`` asks for."""
        trackers = TenantTrackers(run) if run.trainer.logger else None
        return cls(run.output_dir / "metrics.jsonl", run.progress, resumed, trackers)

    def close(self) -> None:
        self._file.close()
        if self.trackers is not None:
            self.trackers.close()


def summarize(records: list[dict[str, Any]], tenants: list[str]) -> list[dict[str, Any]]:
    """One row per tenant: status, steps, accuracy before/after, reward trend and time split."""
    rows = []
    for tenant in tenants:
        mine = [r for r in records if r.get("tenant") == tenant]
        steps = [r for r in mine if r["event"] == "step"]
        evals = [r for r in mine if r["event"] == "eval"]
        failed = [r for r in mine if r["event"] == "failed"]
        stopped = [r for r in mine if r["event"] == "stopped"]
        rows.append({
            "tenant": tenant,
            "status": "failed" if failed else "stopped" if stopped else "ok",
            "error": failed[0]["error"] if failed else None,
            "steps": len(steps),
            "accuracy_start": evals[0]["accuracy"] if evals else None,
            "accuracy_final": evals[-1]["accuracy"] if len(evals) > 1 else None,
            "reward_first": steps[0]["reward_mean"] if steps else None,
            "reward_last": steps[-1]["reward_mean"] if steps else None,
            "rollout_s": sum(r["rollout_s"] for r in steps),
            "train_s": sum(r["train_s"] for r in steps),
            "sync_s": sum(r["sync_s"] for r in steps),
            "generated_tokens": sum(r["generated_tokens"] for r in steps),
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    columns = ["tenant", "status", "steps", "accuracy_start", "accuracy_final", "reward_first", "reward_last",
               "rollout_s", "train_s", "sync_s", "generated_tokens"]
    table = [columns] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(value.rjust(width) for value, width in zip(line, widths)) for line in table]
    finals = [row["accuracy_final"] for row in rows if row["accuracy_final"] is not None]
    if finals:
        spread = statistics.pstdev(finals) if len(finals) > 1 else 0.0
        lines.append(f"mean final accuracy {statistics.mean(finals):.3f} (std over tenants {spread:.3f})")
    return "\n".join(lines)


def reward_figure(records: list[dict[str, Any]], tenants: list[str]) -> Any:
    """A matplotlib figure of every tenant's mean reward per RL step: one distinct colour per tenant (beyond 10,
    golden-ratio hues), the legend outside the axes, whole steps on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colours = plt.get_cmap("tab10").colors[: len(tenants)] if len(tenants) <= 10 else _spread_colours(len(tenants))
    columns = 1 + len(tenants) // 25
    figure, axis = plt.subplots(figsize=(7 + 1.6 * columns, 4))
    for tenant, colour in zip(tenants, colours):
        steps = [r for r in records if r.get("tenant") == tenant and r["event"] == "step"]
        if steps:
            axis.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], marker="o", markersize=3,
                      color=colour, label=tenant)
    axis.set_xlabel("RL step")
    axis.set_ylabel("mean reward")
    axis.set_ylim(-0.05, 1.05)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)
    if axis.lines:  # a run whose every tenant failed has none
        axis.legend(fontsize=7, ncol=columns, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    figure.tight_layout()
    return figure


def _spread_colours(count: int) -> list[tuple[float, float, float]]:
    """``count`` distinct colours, neighbours in the legend far apart: hues stepped by the golden ratio, every
    other one darker."""
    from matplotlib.colors import hsv_to_rgb

    return [tuple(hsv_to_rgb((i * 0.6180339887 % 1.0, 0.85, 0.95 if i % 2 == 0 else 0.6))) for i in range(count)]


def plot_rewards(records: list[dict[str, Any]], tenants: list[str], path: Path) -> None:
    """``reward_figure`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    figure = reward_figure(records, tenants)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_run_summary(output_dir: Path, records: list[dict[str, Any]], specs: list[Any], fields: dict[str, Any],
                      wall_s: float, base_model_s: float, label: str) -> dict[str, Any]:
    """Writes ``summary.json`` (``fields`` + timing, experiments/hour without and with the base model's one-time
    build, per-tenant rows and specs) and
    ``reward_curves.png`` for a finished run of the tenants ``specs`` (dataclasses with a ``name``); prints
    the per-tenant table and a last line starting with ``label``. Returns the summary."""
    names = [spec.name for spec in specs]
    rows = summarize(records, names)
    finished = sum(r["status"] == "ok" for r in rows)
    summary = {
        **fields, "tenants": len(names), "base_model_seconds": base_model_s, "wall_seconds": wall_s,
        "experiments_per_hour": 3600.0 * finished / wall_s,
        "experiments_per_hour_with_base_model": 3600.0 * finished / (wall_s + base_model_s),
        "per_tenant": rows, "tenant_specs": [asdict(spec) for spec in specs],
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_rewards(records, names, output_dir / "reward_curves.png")
    print(format_table(rows))
    print(f"{label} tenants={len(names)} wall {wall_s:.1f}s (+ base model {base_model_s:.1f}s) "
          f"-> {summary['experiments_per_hour']:.1f} experiments/hour "
          f"({summary['experiments_per_hour_with_base_model']:.1f} with the base model's build); outputs in {output_dir}")
    return summary


@dataclass(frozen=True)
class PoolOutcome:
    """What a backend's run of its tenant pool leaves for the run's summary: ``records``, every record of the run
    (metrics.jsonl's, resumed ones included); ``fields``, the backend's own summary keys (mode, steps, engine
    stats, ...); ``label``, the first word of the summary's last printed line (``mode=concurrent``, ...)."""

    records: list[dict[str, Any]]
    fields: dict[str, Any]
    label: str


def summarize_pool(run: RunConfig, pool: Callable[[], PoolOutcome], base_model_s: float) -> dict[str, Any]:
    """The run shell every backend shares: calls ``pool`` (a backend's run of ``run``'s tenants), times it, and
    writes the run's summary (:func:`write_run_summary` over :func:`~skyrl_clora.checkpoints.run_tenants`, the
    tenants added while it went included; ``base_model_s``: the seconds the command spent building the base model).
    Returns the summary."""
    started = time.perf_counter()
    outcome = pool()
    wall_s = time.perf_counter() - started
    return write_run_summary(run.output_dir, outcome.records, run_tenants(run), outcome.fields, wall_s, base_model_s,
                             outcome.label)
