"""Per-tenant metrics: JSONL records, a live status line, the final summary table and reward-curve plot."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from skyrl_clora.checkpoints import run_tenants
from skyrl_clora.config.schema import RunConfig
from skyrl_clora.trackers import TenantTrackers


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
