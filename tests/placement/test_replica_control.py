"""The control endpoint of a replicated run (:mod:`skyrl_clora.placement.replica_control`), over a stand-in of the
driver's :class:`~skyrl_clora.placement.replica_set.ReplicaSet` (no Ray): every request reaches the replicas through
``ReplicaSet.call`` (the driver's thread), a stop's refusal comes back as the endpoint's one-line 400, the endpoint
serves from ``start`` until ``close`` (``control.json`` names it meanwhile), and a failed start is raised by ``start``."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.config.compose import compose_config
from skyrl_clora.config.schema import ConfigError, RunConfig
from skyrl_clora.control.server import CONTROL_FILE
from skyrl_clora.placement.replica_control import ReplicaControl, ReplicaTenants
from skyrl_clora.tenants import TenantSpec
from tests.support.helpers import http_call


class StandInReplicas:
    """What the endpoint asks of a ReplicaSet: ``call`` runs a request (recording the thread it came from), and the
    three requests act on running tenants with their steps done."""

    def __init__(self, running: dict[str, int]) -> None:
        self.running = dict(running)
        self.calls: list[str] = []
        self.added: list[TenantSpec] = []

    def call(self, request: Callable[[], Any]) -> Any:
        self.calls.append(threading.current_thread().name)
        return request()

    def add_tenant(self, spec: TenantSpec) -> None:
        self.added.append(spec)
        self.running[spec.name] = 0

    def stop_tenant(self, name: str) -> None:
        if name not in self.running:
            raise ConfigError(f"tenant {name} is not running here; running: {', '.join(self.running)}")
        del self.running[name]

    def steps_done(self) -> dict[str, int]:
        return dict(self.running)


def _run(out: Path) -> RunConfig:
    return plan_steps(build_run_config(compose_config([f"clora.output_dir={out}", "trainer.max_training_steps=3"])),
                      train_rows=64)


def test_the_tenants_of_the_replicas_are_reached_through_the_drivers_call() -> None:
    replicas = StandInReplicas({"a": 2})
    tenants = ReplicaTenants(replicas)  # type: ignore[arg-type]
    spec = TenantSpec(name="c", seed=3, lr=1e-3, rank=8, alpha=16.0, task_variant="standard", samples_per_prompt=2)
    asyncio.run(tenants.add(spec, source=None))  # type: ignore[arg-type]
    assert replicas.added == [spec] and asyncio.run(tenants.steps_done()) == {"a": 2, "c": 0}
    tenants.stop("a")
    assert replicas.running == {"c": 0} and len(replicas.calls) == 3
    with pytest.raises(ConfigError, match="tenant a is not running here"):
        tenants.stop("a")


def test_the_endpoint_serves_from_start_until_close(tmp_path: Path) -> None:
    replicas = StandInReplicas({"a": 1, "b": 2})
    control = ReplicaControl(_run(tmp_path), replicas, ["a", "b"])  # type: ignore[arg-type]
    control.start()
    try:
        written = json.loads((tmp_path / CONTROL_FILE).read_text())
        bearer = f"Bearer {written['token']}"
        assert http_call(written["url"] + "/tenants", "GET", authorization=bearer) == (200, {"running": [
            {"name": "a", "steps_done": 1, "steps": 3}, {"name": "b", "steps_done": 2, "steps": 3}]})
        assert http_call(written["url"] + "/tenants/b/stop", "POST", authorization=bearer) == (200, {"stopping": "b"})
        status, answer = http_call(written["url"] + "/tenants/zz/stop", "POST", authorization=bearer)
        assert status == 400 and answer == {"error": "tenant zz is not running here; running: a"}
        assert http_call(written["url"] + "/tenants", "GET")[0] == 401
        assert replicas.running == {"a": 1}
        assert len(replicas.calls) == 3, "each authorised request reached the replicas through call"
        assert json.loads((tmp_path / "live_tenants.json").read_text())["stopped"] == ["b"]
    finally:
        control.close()
    assert not (tmp_path / CONTROL_FILE).exists() and not control._thread.is_alive()


def test_a_failed_start_is_raised_by_start(tmp_path: Path) -> None:
    run = _run(tmp_path / "missing")  # control.json cannot be written: its folder does not exist
    control = ReplicaControl(run, StandInReplicas({}), [])  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        control.start()
    control.close()
    assert not control._thread.is_alive()
