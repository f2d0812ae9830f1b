"""The driver's side of a replicated run against a replica that breaks its contract: a replica whose run ends without
reporting a tenant it holds fails that tenant with a record, and the run ends (once the other replica's tenants
ended) instead of waiting for it beside the other replica's open pool."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.support.micro_task import micro_tenants, run_args
from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.config.compose import compose_config
from skyrl_clora.placement.replica_actor import TenantEnd
from skyrl_clora.placement.replica_set import ReplicaSet
from skyrl_clora.placement.ray_session import RAY_SYSTEM_CONFIG

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]  # a driver that waits forever fails at the limit


class Replica:
    """A replica whose run holds its pool open (a second ``wait_ended`` never returns) after reporting the tenants in
    ``ends``; with none, its run ended at once without reporting any of its tenants."""

    def __init__(self, ends: list[TenantEnd]) -> None:
        self.ends = ends
        self.closed = threading.Event()

    def wait_ended(self, seen: int) -> list[TenantEnd]:
        if seen < len(self.ends) or not self.ends:
            return self.ends[seen:]
        self.closed.wait()
        return []

    def close(self) -> dict[str, Any]:
        self.closed.set()
        return {}


def test_tenants_a_replica_never_reported_fail_and_the_run_ends(micro_model_dir: Path, tmp_path: Path) -> None:
    import ray

    cfg = compose_config(run_args(micro_model_dir, tmp_path, micro_tenants({"name": "a"}, {"name": "b"})))
    run = plan_steps(build_run_config(cfg), train_rows=12)
    subs = [replace(run, tenants=(spec,)) for spec in run.tenants]
    # As the package starts Ray (its workers at niceness 0: beside busy processes Ray's default of 15 starves them);
    # the actors import this module.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=dict(RAY_SYSTEM_CONFIG),
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}})
    try:
        actor = ray.remote(Replica).options(max_concurrency=2)
        ends = [[], [TenantEnd("b", "finished", 3)]]
        replicas = ReplicaSet(run, tmp_path / "checkpoints", subs, 1, lambda index, sub, resume: actor.remote(ends[index]))
        replicas.run_all({}, [])
        replicas.close()
    finally:
        ray.shutdown()
    assert replicas.status == {"a": "failed", "b": "finished"}
    assert replicas.records == [{"event": "failed", "tenant": "a",
                                 "error": "replica 0's run ended without reporting tenant a's end"}]
