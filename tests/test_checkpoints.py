"""Runs that last: per-tenant checkpoints written atomically, a run killed with SIGKILL and resumed ending as
an uninterrupted one does, and an output folder that never mixes two runs.

Swap mode (concurrent and serial) and packed mode in lockstep (``clora.pack_policy=lockstep``: each round packs
every tenant's step in tenant order) are compared bit for bit with an uninterrupted run. Packed passes of
whichever tenants are waiting (``ready``, the default) are not reproducible run to run (CPU GEMMs round a row by
the batch it is in), so they are not resumed bit for bit either; lockstep resumes every tenant from the newest
step all of them hold a checkpoint of.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.isolation import assert_same_records, tenant_records
from tests.support.micro_task import (assert_learning, micro_tenants, read_records, register_micro_env, roll_back,
                                      run_args)
from skyrl_clora.checkpoints import LATEST, TenantCheckpoints
from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.main import main

pytestmark = pytest.mark.e2e
TENANTS = [{"name": "a", "seed": 1}, {"name": "b", "seed": 2, "lr": 0.004}, {"name": "c", "seed": 3, "rank": 4},
           {"name": "d", "seed": 4}]
STEPS = 8
# SIGKILL once some tenant has recorded this step, after this many seconds (seeded: the same in every run).
# Five kill points: concurrent swap mode, serial swap mode (tenants one after another) and packed mode.
KILL_POINTS = [(mode, step, round(random.Random(step * 7 + i).uniform(0.0, 0.4), 2))
               for i, (mode, step) in enumerate([("swap", 3), ("serial", 5), ("swap", 6), ("packed", 4), ("packed", 6)])]


def _args(model: Path, out: Path, train_mode: str, *extra: str) -> list[str]:
    lockstep = ["clora.pack_policy=lockstep"] if train_mode == "packed" else []
    return run_args(model, out, micro_tenants(*TENANTS), f"clora.train_mode={train_mode}", "trainer.ckpt_interval=1",
                    *lockstep, *extra, steps=STEPS)


def _main_in_child(args: list[str]) -> None:
    register_micro_env()
    os._exit(main(args))


# Children fork from a single-threaded server that has imported the plugin once (forking this multi-threaded
# test process could deadlock a child on a lock some other thread held).
_CHILDREN = multiprocessing.get_context("forkserver")
_CHILDREN.set_forkserver_preload(["skyrl_clora.main", "tests.support.micro_task"])


def _run_in_child(args: list[str]) -> multiprocessing.Process:
    """``main(args)`` in a child process, its exit status its own."""
    child = _CHILDREN.Process(target=_main_in_child, args=(args,))
    child.start()
    return child


def _wait_for_step(child: multiprocessing.Process, metrics: Path, step: int, tenants: int = 1) -> None:
    """Returns once ``tenants`` tenants' records of RL step ``step`` are in ``metrics``; fails if ``child`` ends
    first."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and child.is_alive():
        if metrics.is_file():
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
            if len({r["tenant"] for r in records if r.get("step") == step and r["event"] == "step"}) >= tenants:
                return
        time.sleep(0.02)
    pytest.fail(f"the run ended (exit {child.exitcode}) before {tenants} tenant(s) reached step {step}")


def _kill_after(child: multiprocessing.Process, metrics: Path, step: int, delay: float) -> None:
    """SIGKILLs ``child`` ``delay`` seconds after some tenant's record of RL step ``step`` reaches ``metrics``."""
    _wait_for_step(child, metrics, step)
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.join()


def _assert_resumed(out: Path, earlier: list[dict], checkpointed: dict[str, int]) -> None:
    """Each tenant's records up to its checkpointed step are the ``earlier`` run's own, wall-clock times
    included: the resumed run carried them over rather than running those steps again."""
    for name, step in checkpointed.items():
        carried = [r for r in earlier if r["tenant"] == name and r["step"] <= step and r["event"] in ("step", "eval")]
        assert carried and [r for r in read_records(out) if r["tenant"] == name][: len(carried)] == carried, name


def _final_state(out: Path, tenant: str) -> dict[str, torch.Tensor]:
    """The trainer state and adapter of the tenant's final (finished) checkpoint."""
    ckpts = out / "checkpoints" / tenant
    folder = ckpts / f"global_step_{int((ckpts / LATEST).read_text())}"
    assert json.loads((folder / "tenant.json").read_text())["finished"]
    return load_file(str(folder / "trainer_state.safetensors"))


def _assert_same_run(got: Path, want: Path) -> None:
    """Per tenant, bit for bit: metrics, final trainer state (masters, moments, gradients, RNG) and exported
    adapter."""
    assert_learning(read_records(want))
    names = [tenant["name"] for tenant in TENANTS]
    finals = {name: tenant_records(want, name)[-2] for name in names}  # the last step's records
    assert len({final["reward_mean"] for final in finals.values()}) == len(names)  # the tenants differ
    for name in names:
        assert_same_records(tenant_records(got, name), tenant_records(want, name), name)
        got_state, want_state = _final_state(got, name), _final_state(want, name)
        assert got_state.keys() == want_state.keys()
        assert torch.equal(got_state["rng_state"], want_state["rng_state"]), name
        for key in want_state:
            assert torch.equal(got_state[key], want_state[key]), (name, key)
        got_adapter, want_adapter = load_peft_adapter(got / "adapters" / name), load_peft_adapter(want / "adapters" / name)
        for path in want_adapter.a:
            assert torch.equal(got_adapter.a[path], want_adapter.a[path]), (name, path)
            assert torch.equal(got_adapter.b[path], want_adapter.b[path]), (name, path)


@pytest.fixture(scope="module")
def uninterrupted(learning_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted run of each train mode (made on first use)."""
    runs: dict[str, Path] = {}

    class Runs(dict):
        def __missing__(self, train_mode: str) -> Path:
            out = tmp_path_factory.mktemp(f"uninterrupted-{train_mode}")
            assert main(_args(learning_model_dir, out, train_mode)) == 0
            self[train_mode] = out
            return out

    return Runs(runs)


@pytest.mark.parametrize("kill_point", KILL_POINTS, ids=[f"{m}-step{s}+{d}s" for m, s, d in KILL_POINTS])
def test_a_run_killed_and_resumed_ends_as_if_never_killed(uninterrupted: dict[str, Path], kill_point: tuple,
                                                         learning_model_dir: Path, tmp_path: Path) -> None:
    mode, step, delay = kill_point
    train_mode = "packed" if mode == "packed" else "swap"
    reference = uninterrupted[train_mode]  # a serial run's tenants end as a concurrent run's (test_isolation)
    args = _args(learning_model_dir, tmp_path, train_mode, *(["clora.mode=serial"] if mode == "serial" else []))
    child = _run_in_child(args)
    _kill_after(child, tmp_path / "metrics.jsonl", step, delay)
    assert child.exitcode == -signal.SIGKILL
    partial = read_records(tmp_path)
    assert len([r for r in partial if r["event"] == "step"]) < len(TENANTS) * STEPS  # the kill came before the end
    latest = {t["name"]: TenantCheckpoints(tmp_path / "checkpoints", t["name"], -1).latest() for t in TENANTS}
    checkpointed = {name: checkpoint.step for name, checkpoint in latest.items() if checkpoint is not None}
    assert checkpointed and min(checkpointed.values()) >= 2  # serial mode: only the tenants that had started
    if train_mode == "packed":  # lockstep: every tenant resumes from the newest step all of them hold
        assert len(checkpointed) == len(TENANTS)
        checkpointed = dict.fromkeys(checkpointed, min(checkpointed.values()))
    assert main(args) == 0  # the same command resumes (trainer.resume_mode=latest)
    _assert_resumed(tmp_path, partial, checkpointed)
    _assert_same_run(tmp_path, reference)


def test_ctrl_c_stops_with_outputs_and_the_same_command_finishes_the_run(uninterrupted: dict[str, Path],
                                                                        learning_model_dir: Path, tmp_path: Path) -> None:
    args = _args(learning_model_dir, tmp_path, "swap", "trainer.ckpt_interval=3")
    child = _run_in_child(args)
    _wait_for_step(child, tmp_path / "metrics.jsonl", 4, tenants=len(TENANTS))  # every tenant past step 4: how far
    # each got by the signal depends on the machine's speed, so the test asserts only what every order gives
    os.kill(child.pid, signal.SIGINT)
    child.join(timeout=120)
    assert child.exitcode == 130
    records = read_records(tmp_path)
    stopped = {r["tenant"]: r["step"] for r in records if r["event"] == "stopped"}
    assert sorted(stopped) == [t["name"] for t in TENANTS] and all(4 <= step < STEPS for step in stopped.values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {row["status"] for row in summary["per_tenant"]} == {"stopped"}
    assert (tmp_path / "reward_curves.png").is_file()
    for name, step in stopped.items():
        assert (tmp_path / "adapters" / name / "adapter_model.safetensors").is_file()
        assert TenantCheckpoints(tmp_path / "checkpoints", name, -1).latest().step == step
    assert main(args) == 0
    _assert_resumed(tmp_path, records, stopped)
    _assert_same_run(tmp_path, uninterrupted["swap"])


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path: Path) -> None:
    checkpoints = TenantCheckpoints(tmp_path, "t", keep=2)

    async def save(folder: Path) -> None:
        (folder / "state.bin").write_bytes(b"x" * 10)

    async def dies_midway(folder: Path) -> None:
        (folder / "state.bin").write_bytes(b"partial")
        raise KeyboardInterrupt  # the process dies here

    asyncio.run(checkpoints.write(3, 3, False, [{"step": 3}], {"k": 1}, save))
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(checkpoints.write(4, 4, False, [{"step": 4}], {"k": 1}, dies_midway))
    latest = checkpoints.latest()
    assert latest.step == 3 and latest.records == [{"step": 3}] and (latest.folder / "state.bin").read_bytes() == b"x" * 10
    assert not (tmp_path / "t" / "global_step_4").exists()
    for step in (4, 5, 6):  # the leftover temporary folder goes; the two newest stay
        asyncio.run(checkpoints.write(step, step, False, [], {"k": 1}, save))
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["global_step_5", "global_step_6", LATEST]
    assert checkpoints.latest().step == 6
    shutil.rmtree(tmp_path / "t" / "global_step_6")  # killed while replacing step 6's checkpoint, before the rename
    assert checkpoints.latest().step == 5


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_used_output_folder_takes_only_its_own_run(learning_model_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    args = run_args(learning_model_dir, tmp_path, micro_tenants(*TENANTS[:2]), steps=2)
    assert main(args) == 0
    before = _listing(tmp_path)
    capsys.readouterr()
    assert main([*args, "generator.sampling_params.max_generate_length=9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: clora.output_dir={tmp_path} holds a run whose config differs in "
                          # evaluation's follows training's (SkyRL's default eval_sampling_params)
                          "generator.eval_sampling_params.max_generate_length, generator.sampling_params.max_generate_length; ")
    assert len(err.splitlines()) == 1
    assert main([*args, "trainer.resume_mode=none"]) == 2
    assert "holds a run; resume it (trainer.resume_mode=latest) or choose a new clora.output_dir" in capsys.readouterr().err
    assert _listing(tmp_path) == before
    records = {name: [r for r in read_records(tmp_path) if r["tenant"] == name] for name in ("a", "b")}
    assert main(args) == 0  # the same config: every tenant had finished, nothing runs again
    assert {name: [r for r in read_records(tmp_path) if r["tenant"] == name] for name in ("a", "b")} == records
    elsewhere = tmp_path / "elsewhere"
    from_path = ["trainer.resume_mode=from_path", f"trainer.resume_path={tmp_path / 'checkpoints'}"]
    moved = run_args(learning_model_dir, elsewhere, micro_tenants(*TENANTS[:2]), *from_path, steps=2)
    assert main([*moved, "trainer.policy.optimizer_config.lr=0.01"]) == 2
    assert "tenant a's checkpoints were written by a run whose config differs in tenants.a, trainer.policy.optimizer_config.lr" in capsys.readouterr().err
    assert main(moved) == 0  # the checkpoints continue in another folder: finished there too
    assert {name: [r for r in read_records(elsewhere) if r["tenant"] == name] for name in ("a", "b")} == records
    for name in ("a", "b"):
        adapter, there = load_peft_adapter(tmp_path / "adapters" / name), load_peft_adapter(elsewhere / "adapters" / name)
        assert all(torch.equal(adapter.b[path], there.b[path]) for path in adapter.b)


@pytest.mark.usefixtures("without_production_extras")
@pytest.mark.ray
def test_backend_skyrl_resumes_a_tenant_from_its_checkpoint(learning_model_dir: Path, tmp_path: Path) -> None:
    """backend=skyrl: the Ray policy worker writes and reads the tenants' training state; rolled back to their
    step-2 checkpoints, the same command ends the run as it ended before."""
    specs = ({"name": "a", "seed": 1, "lr": "1e-2"}, {"name": "b", "seed": 2, "lr": "3e-3"})
    args = run_args(learning_model_dir, tmp_path, micro_tenants(*specs), "backend=skyrl", "trainer.ckpt_interval=1")
    assert main(args) == 0
    assert_learning(read_records(tmp_path))
    before = {name: (tenant_records(tmp_path, name), load_peft_adapter(tmp_path / "adapters" / name)) for name in "ab"}
    assert before["a"][0] != before["b"][0]
    earlier = read_records(tmp_path)
    for name in "ab":
        roll_back(tmp_path, name, 2)
    assert main(args) == 0
    _assert_resumed(tmp_path, earlier, {"a": 2, "b": 2})
    for name, (records, adapter) in before.items():
        assert_same_records(tenant_records(tmp_path, name), records, name)
        resumed = load_peft_adapter(tmp_path / "adapters" / name)
        for path in adapter.a:
            assert torch.equal(resumed.a[path], adapter.a[path]) and torch.equal(resumed.b[path], adapter.b[path])


def _ctl(out: Path, *args: str) -> int:
    from skyrl_clora import ctl

    return ctl.main(["--dir", str(out), *args])


def test_tenants_join_and_leave_a_live_run(uninterrupted: dict[str, Path], learning_model_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    """Started with a and b; c joins after a's step 2, b is stopped after its step 3. a ends as in a run without
    the changes and c as in a run it started with, bit for bit; bad requests are refused and the run goes on."""
    reference = uninterrupted["swap"]
    a, b, c = TENANTS[0], TENANTS[1], TENANTS[2]
    args = run_args(learning_model_dir, tmp_path, micro_tenants(a, b), "trainer.ckpt_interval=1", "clora.max_tenants=3",
                    steps=STEPS)
    child = _run_in_child(args)
    _wait_for_step(child, tmp_path / "metrics.jsonl", 2)
    assert _ctl(tmp_path, "add", "{seed: 9}") == 2
    assert "an added tenant needs its overrides as a mapping with a name" in capsys.readouterr().err
    assert _ctl(tmp_path, "add", "{name: a}") == 2
    assert "tenant name a is taken in this run" in capsys.readouterr().err
    assert _ctl(tmp_path, "add", "{name: x, task_variant: nope}") == 2
    assert "unknown gsm8k task variant 'nope'" in capsys.readouterr().err
    added = "{" + ", ".join(f"{key}: {value}" for key, value in {**c, "env_class": "micro_letters"}.items()) + "}"
    assert _ctl(tmp_path, "add", added) == 0
    assert json.loads(capsys.readouterr().out)["added"]["name"] == "c"
    assert _ctl(tmp_path, "add", "{name: d, env_class: micro_letters}") == 2
    assert "3 tenants hold adapter slots, the most this run has (clora.max_tenants=3;" in capsys.readouterr().err
    _wait_for_step(child, tmp_path / "metrics.jsonl", 3)
    assert _ctl(tmp_path, "stop", "b") == 0
    assert _ctl(tmp_path, "add", "{name: d, env_class: micro_letters}") == 2  # b keeps its slot until the run ends
    assert "3 tenants hold adapter slots" in capsys.readouterr().err
    assert _ctl(tmp_path, "stop", "nobody") == 2
    assert "tenant nobody is not running here" in capsys.readouterr().err
    child.join(timeout=300)
    assert child.exitcode == 0 and not (tmp_path / "control.json").exists()
    assert_same_records(tenant_records(tmp_path, "a"), tenant_records(reference, "a"), "a")
    assert_same_records(tenant_records(tmp_path, "c"), tenant_records(reference, "c"), "c")
    b_records = [r for r in read_records(tmp_path) if r["tenant"] == "b"]
    assert b_records[-1]["event"] == "stopped" and 3 <= b_records[-1]["step"] < STEPS
    assert (tmp_path / "adapters" / "b").is_dir()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {row["tenant"]: row["status"] for row in summary["per_tenant"]} == {"a": "ok", "b": "stopped", "c": "ok"}
    records = read_records(tmp_path)
    assert main(args) == 0  # resuming: c is part of the run, b stays stopped, nothing runs again
    assert {r["tenant"] for r in read_records(tmp_path)} == {"a", "b", "c"}
    assert [r for r in read_records(tmp_path) if r["tenant"] == "c"] == [r for r in records if r["tenant"] == "c"]


@pytest.mark.ray
def test_a_skyrl_run_killed_with_sigkill_leaves_no_ray_process(learning_model_dir: Path, tmp_path: Path) -> None:
    """backend=skyrl starts Ray's head processes and workers; a SIGKILL of the run takes them all with it."""
    import psutil

    args = run_args(learning_model_dir, tmp_path, micro_tenants({"name": "a", "seed": 1}), "backend=skyrl",
                    "backend.inference_backend=embedded", "backend.strategy=embedded", steps=STEPS)
    child = _run_in_child(args)
    _wait_for_step(child, tmp_path / "metrics.jsonl", 1)
    ray_processes = [p for p in psutil.Process(child.pid).children(recursive=True) if "ray" in " ".join(p.cmdline())]
    assert len(ray_processes) >= 2  # at least Ray's GCS server and raylet
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]


def test_a_lockstep_run_resumes_every_tenant_from_the_newest_step_all_hold(tmp_path: Path) -> None:
    """A kill between two tenants' checkpoints of one round leaves a at step 4, b at 3: both resume from 3 (a's
    older checkpoint); a tenant with no checkpoint of that step is a one-line error."""
    from skyrl_clora.checkpoints import claim_output_dir
    from skyrl_clora.config.schema import ConfigError
    from skyrl_clora.config.build import build_run_config
    from skyrl_clora.config.compose import compose_config

    run = build_run_config(compose_config(["+tenants=2", f"clora.output_dir={tmp_path}", "clora.train_mode=packed",
                                           "clora.pack_policy=lockstep"]))
    run, resume, _ = claim_output_dir(run)
    assert resume == {}

    async def save(folder: Path) -> None:
        (folder / "state.bin").write_bytes(b"x")

    names = [spec.name for spec in run.tenants]
    for name, steps in zip(names, ([2, 3, 4], [2, 3])):
        for step in steps:
            asyncio.run(TenantCheckpoints(tmp_path / "checkpoints", name, 2).write(
                step, step, False, [{"step": step}], run.identity, save))
    _, resume, _ = claim_output_dir(run)
    assert {name: checkpoint.step for name, checkpoint in resume.items()} == {names[0]: 3, names[1]: 3}
    assert resume[names[0]].records == [{"step": 3}]
    shutil.rmtree(tmp_path / "checkpoints" / names[0] / "global_step_3")
    with pytest.raises(ConfigError, match="no checkpoint of step 3"):
        claim_output_dir(run)
