"""Tenants spread over Ray actor replicas on the CPU (``clora.replicas``): each tenant ends exactly as in a
one-replica run, a tenant moved between live replicas mid-run too, and a replica that dies mid-run costs its
tenants only the steps since their last checkpoint."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import skyrl_gym

from tests.support.isolation import assert_same_records, tenant_records
from tests.support.markers import replicated_runs_limit
from tests.support.micro_task import LetterRewardEnv, micro_tenants, read_records, register_micro_env, run_args
from skyrl_clora.main import main
from skyrl_clora.placement import replicas
from skyrl_clora.placement.replicas import Move

pytestmark = [pytest.mark.e2e, replicated_runs_limit]
DYING_ENV = "micro_letters_dying"
GATED_ENV = "micro_letters_gated"
TENANTS = [{"name": "a", "seed": 1, "lr": "1e-2"}, {"name": "b", "seed": 2, "lr": "3e-3", "rank": 4},
           {"name": "c", "seed": 3, "lr": "5e-3", "alpha": 8}]


class DyingLetterEnv(LetterRewardEnv):
    """``micro_letters`` whose process exits at its ``after``-th episode of this environment, ``times`` times in
    all: the k-th death makes the file ``marker`` (k = 1) or ``<marker>.<k>``, and none comes once they all exist."""

    episodes = 0

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None, marker: str = "",
                 after: int = 0, times: int = 1) -> None:
        super().__init__(env_config, extras)
        DyingLetterEnv.episodes += 1
        deaths = [Path(marker if k == 1 else f"{marker}.{k}") for k in range(1, times + 1)]
        if DyingLetterEnv.episodes == after and not all(death.exists() for death in deaths):
            next(death for death in deaths if not death.exists()).touch()
            os._exit(1)


class GatedLetterEnv(LetterRewardEnv):
    """``micro_letters`` whose ``after``-th and later episodes in a process wait for the file ``gate`` to exist:
    the tenants of one replica hold still at a known point until another replica's tenant has written it."""

    episodes = 0

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None, gate: str = "",
                 after: int = 0) -> None:
        super().__init__(env_config, extras)
        GatedLetterEnv.episodes += 1
        while GatedLetterEnv.episodes >= after and not os.path.exists(gate):
            time.sleep(0.05)  # an order between replicas, not a duration: the wait ends when the file appears


@pytest.fixture(autouse=True)
def _ray_shut_down():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _args(model_dir: Path, out: Path, tenants: list[dict[str, Any]], *extra: str) -> list[str]:
    register_micro_env()
    return run_args(model_dir, out, micro_tenants(*tenants), "trainer.ckpt_interval=1", *extra, steps=4)


@pytest.fixture(scope="module")
def one_replica(learning_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-replica run of ``TENANTS`` without interval checkpoints (a moved tenant's only mid-run checkpoints
    are the ones its moves write)."""
    out = tmp_path_factory.mktemp("one_replica")
    assert main(_args(learning_model_dir, out, TENANTS, "trainer.ckpt_interval=0")) == 0
    return out


def _same_tenants(got: Path, want: Path) -> None:
    for name in "abc":
        records = tenant_records(got, name)
        assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3, 4], name
        assert_same_records(records, tenant_records(want, name), name)


@pytest.mark.ray
def test_tenants_on_two_replicas_end_as_on_one(learning_model_dir: Path, tmp_path: Path) -> None:
    assert main(_args(learning_model_dir, tmp_path / "one", TENANTS)) == 0
    assert main(_args(learning_model_dir, tmp_path / "two", TENANTS, "clora.replicas=2")) == 0
    one = read_records(tmp_path / "one")
    finals = {r["tenant"]: r["reward_mean"] for r in one if r["event"] == "step" and r["step"] == 4}
    assert len(set(finals.values())) == 3, "the tenants' runs must differ"
    _same_tenants(tmp_path / "two", tmp_path / "one")
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert sorted(len(group) for group in summary["replicas"]) == [1, 2]
    assert all(row["status"] == "ok" for row in summary["per_tenant"])
    assert all((tmp_path / "two" / "adapters" / name / "adapter_config.json").is_file() for name in "abc")
    import ray

    niceness = ray.remote(lambda: os.nice(0))  # run in a worker of the Ray the run started
    assert ray.get(niceness.remote()) == 0, "the run's Ray workers at Ray's default niceness, 15"


@pytest.mark.ray
def test_a_tenant_moved_between_live_replicas_mid_run_ends_as_on_one(learning_model_dir: Path, tmp_path: Path,
                                                                     one_replica: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``a`` moves to the other replica after step 1 and back after step 3 (to a replica it held a slot on); ``c``
    moves before its first step (after its first evaluation: it starts afresh there)."""
    moves = [Move("a", to=1, after_step=1), Move("a", to=0, after_step=3), Move("c", to=1, after_step=0)]
    monkeypatch.setattr(replicas, "run_replicated", functools.partial(replicas.run_replicated, moves=moves))
    assert main(_args(learning_model_dir, tmp_path, TENANTS, "trainer.ckpt_interval=0", "clora.replicas=2")) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replicas"] == [["a", "c"], ["b"]], "the moves assume this plan"
    assert [move for move in summary["moves"] if move["tenant"] == "a"] == [
        {"tenant": "a", "from": 0, "to": 1, "step": 1}, {"tenant": "a", "from": 1, "to": 0, "step": 3}]
    assert next(move for move in summary["moves"] if move["tenant"] == "c") == {"tenant": "c", "from": 0, "to": 1,
                                                                                "step": 0}
    assert all(row["status"] == "ok" for row in summary["per_tenant"])
    assert (tmp_path / "adapters" / "a" / "adapter_config.json").is_file()
    _same_tenants(tmp_path, one_replica)


@pytest.mark.ray
def test_a_replica_out_of_tenants_takes_one_from_a_busy_replica(learning_model_dir: Path, tmp_path: Path,
                                                               one_replica: Path) -> None:
    """``a`` and ``c`` (replica 0) hold still early in step 1 until ``b`` (replica 1) has finished: replica 1 is then
    out of tenants while replica 0 has two with steps left, and the driver moves one of them over."""
    gate = tmp_path / "checkpoints" / "b" / "global_step_4" / "tenant.json"  # b's final checkpoint
    skyrl_gym.register(id=GATED_ENV, entry_point=f"{__name__}:{GatedLetterEnv.__name__}",
                       kwargs={"gate": str(gate), "after": 40})  # each tenant has 8 evaluation then 32 step-1 episodes
    try:
        tenants = [dict(spec) for spec in TENANTS]
        tenants[0]["env_class"] = tenants[2]["env_class"] = GATED_ENV
        assert main(_args(learning_model_dir, tmp_path, tenants, "trainer.ckpt_interval=0", "clora.replicas=2")) == 0
    finally:
        skyrl_gym.envs.registration.registry.pop(GATED_ENV, None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replicas"] == [["a", "c"], ["b"]]
    assert len(summary["moves"]) == 1 and summary["moves"][0]["tenant"] in "ac", summary["moves"]
    assert {key: summary["moves"][0][key] for key in ("from", "to")} == {"from": 0, "to": 1}
    _same_tenants(tmp_path, one_replica)


@pytest.mark.ray
def test_tenants_join_and_leave_a_replicated_run_through_ctl(learning_model_dir: Path, tmp_path: Path,
                                                             one_replica: Path, capsys: pytest.CaptureFixture) -> None:
    """Started with a and b on two replicas; c joins and b is stopped through ``ctl`` as soon as the endpoint serves
    (b holds still at its first step's first episode until its stop is about to be asked for, so that it still has
    steps left when the stop arrives; the gate opens before the request because b's replica serves a stop on the
    event loop b's waiting episode holds); bad requests are refused. a and c end as in a one-replica run started
    with all three."""
    from skyrl_clora import ctl

    answers: dict[str, int] = {}
    gate = tmp_path / "b-stop-coming"

    def control() -> None:
        try:
            while not (tmp_path / "control.json").exists():
                time.sleep(0.05)  # until the run serves its endpoint
            added = "{name: c, seed: 3, lr: 0.005, alpha: 8, env_class: micro_letters}"  # TENANTS[2]
            for name, args in {"add c": ["add", added], "add a": ["add", "{name: a}"], "stop b": ["stop", "b"],
                               "stop nobody": ["stop", "nobody"], "list": ["list"]}.items():
                if name == "stop b":
                    gate.touch()
                answers[name] = ctl.main(["--dir", str(tmp_path), *args])
        finally:
            gate.touch()  # a failed call must not leave b waiting forever: the run ends and the answers assert fails

    skyrl_gym.register(id=GATED_ENV, entry_point=f"{__name__}:{GatedLetterEnv.__name__}",
                       kwargs={"gate": str(gate), "after": 9})  # b's 8 evaluation episodes, then its step 1's
    client = threading.Thread(target=control)
    client.start()
    try:
        started = [TENANTS[0], {**TENANTS[1], "env_class": GATED_ENV}]
        assert main(_args(learning_model_dir, tmp_path, started, "trainer.ckpt_interval=0", "clora.replicas=2")) == 0
    finally:
        skyrl_gym.envs.registration.registry.pop(GATED_ENV, None)
    client.join()
    assert answers == {"add c": 0, "add a": 2, "stop b": 0, "stop nobody": 2, "list": 0}, answers
    err = capsys.readouterr().err
    assert "tenant name a is taken in this run" in err and "tenant nobody is not running here" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {row["tenant"]: row["status"] for row in summary["per_tenant"]} == {"a": "ok", "b": "stopped", "c": "ok"}
    for name in "ac":
        assert_same_records(tenant_records(tmp_path, name), tenant_records(one_replica, name), name)
    b_records = tenant_records(tmp_path, "b")
    assert b_records[-1]["event"] == "stopped" and b_records[-1]["step"] < 4
    assert_same_records(b_records[:-1], tenant_records(one_replica, "b")[:len(b_records) - 1], "b")
    assert not (tmp_path / "control.json").exists()


@pytest.mark.ray
def test_a_lost_replica_resumes_its_tenants_from_their_last_checkpoints(learning_model_dir: Path, tmp_path: Path,
                                                                       capfd: pytest.CaptureFixture) -> None:
    marker = tmp_path / "died"
    skyrl_gym.register(id=DYING_ENV, entry_point=f"{__name__}:{DyingLetterEnv.__name__}",
                       kwargs={"marker": str(marker), "after": 80})  # mid-run: 32 episodes a step, and evaluations
    try:
        tenants = [dict(spec) for spec in TENANTS]
        tenants[1]["env_class"] = DYING_ENV
        marker.touch()  # the reference run does not die
        assert main(_args(learning_model_dir, tmp_path / "one", tenants)) == 0
        marker.unlink()
        assert main(_args(learning_model_dir, tmp_path / "two", tenants, "clora.replicas=2")) == 0
        assert marker.exists(), "the replica must have died"
    finally:
        skyrl_gym.envs.registration.registry.pop(DYING_ENV, None)
    assert "was lost; its tenants resume from their last checkpoints" in capfd.readouterr().err
    _same_tenants(tmp_path / "two", tmp_path / "one")


@pytest.mark.ray
def test_the_tenants_of_a_replica_lost_for_good_go_on_on_another(learning_model_dir: Path, tmp_path: Path,
                                                                 one_replica: Path, capfd: pytest.CaptureFixture) -> None:
    """b's replica dies within b's first step each time it runs, until it is given up: b goes on on replica 0 from
    scratch (it has no checkpoint; two tenants a replica: once a tenant there has ended, if none has yet), and ends
    as in a one-replica run."""
    skyrl_gym.register(id=DYING_ENV, entry_point=f"{__name__}:{DyingLetterEnv.__name__}",
                       kwargs={"marker": str(tmp_path / "died"), "after": 40,
                               "times": replicas.REPLICA_RESTARTS + 1})
    try:
        tenants = [dict(spec) for spec in TENANTS]
        tenants[1]["env_class"] = DYING_ENV
        assert main(_args(learning_model_dir, tmp_path, tenants, "clora.replicas=2", "clora.max_tenants=2")) == 0
    finally:
        skyrl_gym.envs.registration.registry.pop(DYING_ENV, None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replicas"] == [["a", "c"], ["b"]]
    assert {row["tenant"]: row["status"] for row in summary["per_tenant"]} == {"a": "ok", "b": "ok", "c": "ok"}
    assert summary["moves"] == [{"tenant": "b", "from": 1, "to": 0, "step": 0}]
    assert "replica 1 was lost 3 times" in capfd.readouterr().err
    _same_tenants(tmp_path, one_replica)


@pytest.mark.parametrize("extra", ["clora.mode=serial", "backend=skyrl", "clora.replicas=0"])
def test_replicas_outside_a_concurrent_embedded_run_are_refused(extra: str, micro_model_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    replicas = [] if extra.startswith("clora.replicas") else ["clora.replicas=2"]
    assert main([f"trainer.policy.model.path={micro_model_dir}", f"clora.output_dir={tmp_path}", *replicas, extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "clora.replicas" in err[0], err
