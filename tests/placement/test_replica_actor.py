"""A replica's side of the driver contract, in this process (no Ray): every tenant it was given is reported ended,
also when the driver's forwarded signal arrives before the replica's tenants start (a replica slow to start while
another's tenant sends the signal), where the driver would otherwise wait for them forever."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.micro_task import micro_tenants, read_records, run_args
from skyrl_clora.checkpoints import prepare_output_dir
from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.control.interrupts import STOP
from skyrl_clora.config.compose import compose_config
from skyrl_clora.placement.replica_actor import ReplicaRunner, TenantEnd


@pytest.fixture
def no_signal() -> Iterator[None]:
    """STOP as a fresh process has it, before and after the test."""
    STOP.signal = None
    yield
    STOP.signal = None


def _replica(model_dir: Path, out: Path) -> ReplicaRunner:
    cfg = compose_config(run_args(model_dir, out, micro_tenants({"name": "a"}, {"name": "b", "seed": 2}),
                                  "clora.control=false"))
    run = plan_steps(build_run_config(cfg), train_rows=12)
    prepare_output_dir(run.output_dir)
    return ReplicaRunner(run, {}, {})


def test_a_signal_before_the_tenants_start_reports_each_stopped(micro_model_dir: Path, tmp_path: Path,
                                                                no_signal: None) -> None:
    STOP.request(signal.SIGINT)  # forwarded by the driver before this replica's run reached its tenants
    replica = _replica(micro_model_dir, tmp_path)
    assert replica.wait_ended(0) == [TenantEnd("a", "stopped", 0), TenantEnd("b", "stopped", 0)]
    replica.close()
    assert [(r["event"], r["tenant"], r["step"]) for r in read_records(tmp_path)] == [("stopped", "a", 0),
                                                                                       ("stopped", "b", 0)]
    assert {row["status"] for row in json.loads((tmp_path / "summary.json").read_text())["per_tenant"]} == {"stopped"}


def test_without_a_signal_the_tenants_run_and_their_ends_are_reported(micro_model_dir: Path, tmp_path: Path,
                                                                      no_signal: None) -> None:
    replica = _replica(micro_model_dir, tmp_path)
    ends = replica.wait_ended(0)
    ends += replica.wait_ended(len(ends)) if len(ends) < 2 else []
    assert sorted(ends, key=lambda end: end.tenant) == [TenantEnd("a", "finished", 3), TenantEnd("b", "finished", 3)]
    replica.close()
