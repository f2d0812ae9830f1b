"""Signals to a replicated run (:mod:`skyrl_clora.placement.replicas`, ``clora.replicas=2``): a signal to the driver
stops it as it stops a one-replica run: on the first, every replica's tenants stop after their current step with a
checkpoint, the run writes its files and exits 130, and the same command then ends every tenant as an uninterrupted
run does; a second aborts at once (130), and the same command resumes from the last checkpoints.

The signals come from tenant ``b``'s environment (in its replica's process) at a known episode, so that ``b``
stops after a known step; the environment waits, between signals, until the driver has forwarded the first to
its replica."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import skyrl_gym

from tests.support.isolation import assert_same_records, tenant_records, without_run_dependent
from tests.support.markers import replicated_runs_limit
from tests.support.micro_task import LetterRewardEnv, micro_tenants, read_records, register_micro_env, run_args
from skyrl_clora.checkpoints import TenantCheckpoints
from skyrl_clora.control.interrupts import STOP
from skyrl_clora.main import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, replicated_runs_limit]
SIGNAL_ENV = "micro_letters_signalling"
STEPS = 6
B_STOPS_AFTER = 3  # b (alone on its replica) has 8 evaluation episodes, then 32 a step: episode 73 opens step 3
TENANTS = [{"name": "a", "seed": 1, "lr": "1e-2"}, {"name": "b", "seed": 2, "lr": "3e-3", "rank": 4,
                                                     "env_class": SIGNAL_ENV},
           {"name": "c", "seed": 3, "lr": "5e-3", "alpha": 8}]
FORWARD_WAIT_S = 120  # a safety net only: the wait ends when the driver's forwarded stop arrives


class SignallingLetterEnv(LetterRewardEnv):
    """``micro_letters`` that, at its process's ``after``-th episode and while ``marker`` does not exist (it is
    made then), sends ``signals`` SIGINTs to process ``driver``; after the first it waits until this process's
    tenants were asked to stop (the driver took that signal and forwarded it), so each signal is taken alone; after a
    second it holds its step until the driver ends the process."""

    episodes = 0

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None, driver: int = 0,
                 marker: str = "", after: int = 0, signals: int = 1) -> None:
        super().__init__(env_config, extras)
        SignallingLetterEnv.episodes += 1
        if SignallingLetterEnv.episodes != after or os.path.exists(marker):
            return
        Path(marker).touch()
        os.kill(driver, signal.SIGINT)
        deadline = time.monotonic() + FORWARD_WAIT_S
        while not STOP.requested():
            if time.monotonic() > deadline:
                raise RuntimeError("the driver did not forward the signal to this replica")
            time.sleep(0.05)  # an order between processes, not a duration: the wait ends when the stop arrives
        if signals > 1:
            os.kill(driver, signal.SIGINT)
            while time.monotonic() < deadline + FORWARD_WAIT_S:
                time.sleep(0.05)  # held until the driver ends this process: the step cannot end first
            raise RuntimeError("the driver did not end this replica on the second signal")


@pytest.fixture(autouse=True)
def _ray_shut_down():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    register_micro_env()
    return run_args(model_dir, out, micro_tenants(*TENANTS), *extra, steps=STEPS)


def _register(marker: Path, signals: int) -> None:
    skyrl_gym.register(id=SIGNAL_ENV, entry_point=f"{__name__}:{SignallingLetterEnv.__name__}",
                       kwargs={"driver": os.getpid(), "marker": str(marker), "after": 8 + 32 * (B_STOPS_AFTER - 1) + 1,
                               "signals": signals})


@pytest.fixture(scope="module")
def uninterrupted(learning_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-replica run of ``TENANTS`` that no signal stops."""
    out = tmp_path_factory.mktemp("uninterrupted")
    marker = out / "signalled"
    marker.touch()
    _register(marker, signals=1)
    try:
        assert main(_args(learning_model_dir, out, "trainer.ckpt_interval=0")) == 0
    finally:
        skyrl_gym.envs.registration.registry.pop(SIGNAL_ENV, None)
    return out


def _same_as(got: Path, want: Path) -> None:
    finals = {r["tenant"]: r["reward_mean"] for r in read_records(want) if r["event"] == "step" and r["step"] == STEPS}
    assert len(set(finals.values())) == len(TENANTS), "the tenants' runs must differ"
    for name in "abc":
        records = tenant_records(got, name)
        assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, STEPS + 1)), name
        assert_same_records(records, tenant_records(want, name), name)


def test_ctrl_c_stops_every_replica_at_a_step_boundary_and_the_same_command_finishes(
        learning_model_dir: Path, tmp_path: Path, uninterrupted: Path) -> None:
    """No interval checkpoints: the checkpoints a tenant holds after the signal are the ones its stop wrote."""
    args = _args(learning_model_dir, tmp_path, "trainer.ckpt_interval=0", "clora.replicas=2")
    _register(tmp_path / "signalled", signals=1)
    try:
        assert main(args) == 130
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["replicas"] == [["a", "c"], ["b"]], "b's signal assumes it runs alone"
        assert {row["status"] for row in summary["per_tenant"]} == {"stopped"}
        records = read_records(tmp_path)
        stopped = {r["tenant"]: r["step"] for r in records if r["event"] == "stopped"}
        assert sorted(stopped) == ["a", "b", "c"] and stopped["b"] == B_STOPS_AFTER, stopped
        assert all(step < STEPS for step in stopped.values()), stopped
        for name, step in stopped.items():
            # A replica that started after the signal was forwarded (a busy machine) started none of its tenants:
            # they stop where they were, as a serial run's later tenants do, with nothing to export.
            started = any(r["tenant"] == name and r["event"] != "stopped" for r in records)
            assert (tmp_path / "adapters" / name / "adapter_model.safetensors").is_file() == started, name
            latest = TenantCheckpoints(tmp_path / "checkpoints", name, -1).latest()
            assert (latest.step if latest else 0) == step, name
        assert main(args) == 0  # the same command resumes every tenant
    finally:
        skyrl_gym.envs.registration.registry.pop(SIGNAL_ENV, None)
    for name, step in stopped.items():
        # A tenant's records up to its stop step are carried over from the first run, not run again. One stopped
        # before its first step has no checkpoint: its step-0 evaluation runs again, the same but for its wall times.
        carried = [r for r in records if r["tenant"] == name and r["event"] in ("step", "eval") and r["step"] <= step]
        resumed = [r for r in read_records(tmp_path) if r["tenant"] == name][:len(carried)]
        if step == 0:
            resumed, carried = without_run_dependent(resumed), without_run_dependent(carried)
        assert resumed == carried, name
    _same_as(tmp_path, uninterrupted)


def test_a_second_ctrl_c_aborts_at_once_and_the_same_command_resumes(learning_model_dir: Path, tmp_path: Path,
                                                                    uninterrupted: Path) -> None:
    """b's environment holds b's step 3 until the second signal is sent: b cannot stop gracefully before it."""
    args = _args(learning_model_dir, tmp_path, "trainer.ckpt_interval=1", "clora.replicas=2")
    _register(tmp_path / "signalled", signals=2)
    try:
        assert main(args) == 130
        assert not (tmp_path / "summary.json").exists(), "an aborted run writes no summary"
        b_steps = [r["step"] for r in read_records(tmp_path) if r["tenant"] == "b" and r["event"] == "step"]
        assert b_steps == list(range(1, B_STOPS_AFTER)), "b was aborted within its step 3"
        assert main(args) == 0
    finally:
        skyrl_gym.envs.registration.registry.pop(SIGNAL_ENV, None)
    _same_as(tmp_path, uninterrupted)
