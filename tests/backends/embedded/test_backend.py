"""End to end on the embedded backend: tenants, modes, outputs, reproducibility, a failing tenant."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import skyrl_gym
import torch
from skyrl_gym.envs.base_text_env import BaseTextEnv
from transformers import AutoModelForCausalLM

from tests.support.micro_task import assert_learning, micro_tenants, read_records
from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.main import main

pytestmark = pytest.mark.e2e


def _args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"trainer.policy.model.path={model_dir}", "preset=demo", f"clora.output_dir={out}", "trainer.max_training_steps=2",
        "clora.progress=false", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2", "recipe.eval_prompts=2",
        "generator.sampling_params.max_generate_length=8", "generator.max_turns=2", "trainer.max_prompt_length=120", *extra,
    ]


def _step_metrics(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    def is_timing(key: str) -> bool:
        return key in ("rollout_s", "train_s", "sync_s") or "trajectory_time" in key

    return sorted(({k: v for k, v in r.items() if not is_timing(k)} for r in records),
                  key=lambda r: (r["tenant"], r["event"], r["step"]))


def test_concurrent_run_writes_every_output(learning_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(_args(learning_model_dir, out, micro_tenants({}, {}))) == 0
    assert_learning(read_records(out))
    steps = [r for r in _step_metrics(out) if r["event"] == "step"]
    assert sorted((r["tenant"], r["step"], r["adapter_version"]) for r in steps) == [
        ("tenant-0", 1, 1), ("tenant-0", 2, 2), ("tenant-1", 1, 1), ("tenant-1", 2, 2)]
    assert all(r["episodes"] == 4 and r["generated_tokens"] > 0 for r in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "concurrent" and len(summary["cold_start_seconds"]) == 1
    assert [row["status"] for row in summary["per_tenant"]] == ["ok", "ok"]
    waits = summary["queue_wait_seconds"]  # 2 steps of 4 episodes, one request per turn
    assert sorted(waits) == ["tenant-0", "tenant-1"] and all(w["requests"] >= 8 for w in waits.values())
    assert (out / "reward_curves.png").stat().st_size > 1000
    base = AutoModelForCausalLM.from_pretrained(learning_model_dir)
    loaded = peft.PeftModel.from_pretrained(base, str(out / "adapters" / "tenant-1"))
    exported = load_peft_adapter(out / "adapters" / "tenant-1")
    assert loaded.peft_config["default"].r == 16
    path = next(iter(exported.b))
    peft_b = loaded.get_submodule(f"base_model.model.{path}").lora_B["default"].weight
    assert exported.b[path].abs().sum() > 0 and torch.equal(peft_b.detach(), exported.b[path])


def test_same_command_gives_the_same_metrics(learning_model_dir: Path, tmp_path: Path) -> None:
    args = (micro_tenants({"seed": 1}, {"seed": 2, "lr": "5e-3"}),)
    assert main(_args(learning_model_dir, tmp_path / "a", *args)) == 0
    assert main(_args(learning_model_dir, tmp_path / "b", *args)) == 0
    assert_learning(read_records(tmp_path / "a"))
    adapters = [load_peft_adapter(tmp_path / "a" / "adapters" / name).b for name in ("tenant-0", "tenant-1")]
    assert any(not torch.equal(adapters[0][path], adapters[1][path]) for path in adapters[0]), "tenants must differ"
    assert _step_metrics(tmp_path / "a") == _step_metrics(tmp_path / "b")


def test_serial_mode_pays_a_cold_start_per_tenant(learning_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serial"
    assert main(_args(learning_model_dir, out, micro_tenants({}, {}), "clora.mode=serial")) == 0
    assert_learning(read_records(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "serial" and len(summary["cold_start_seconds"]) == 2
    assert [row["steps"] for row in summary["per_tenant"]] == [2, 2]
    assert sorted(summary["queue_wait_seconds"]) == ["tenant-0", "tenant-1"], "each group's engine's tenants"


class RaisingRewardEnv(BaseTextEnv):
    """An environment whose reward function raises, as a buggy user reward would."""

    def __init__(self, env_config=None, extras=None) -> None:
        super().__init__()

    def step(self, action: str):
        raise RuntimeError("reward function exploded")


def test_a_failing_tenant_does_not_take_the_others_down(micro_model_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    if "raising_reward" not in skyrl_gym.registry:
        skyrl_gym.register(id="raising_reward", entry_point=RaisingRewardEnv)
    out = tmp_path / "failing"
    assert main(_args(micro_model_dir, out, "+tenants=[{},{env_class:raising_reward},{}]")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: 1 of 3 tenants failed (tenant-1); their errors are in {out / 'summary.json'}"
    summary = json.loads((out / "summary.json").read_text())
    status = {row["tenant"]: (row["status"], row["steps"]) for row in summary["per_tenant"]}
    assert status == {"tenant-0": ("ok", 2), "tenant-1": ("failed", 0), "tenant-2": ("ok", 2)}
    failed = next(row for row in summary["per_tenant"] if row["status"] == "failed")
    assert "reward function exploded" in failed["error"]
    assert (out / "adapters" / "tenant-2" / "adapter_model.safetensors").is_file()
    every = tmp_path / "every-tenant-fails"
    assert main(_args(micro_model_dir, every, "+tenants=[{env_class:raising_reward},{env_class:raising_reward}]")) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: 2 of 2 tenants failed (tenant-0, tenant-1)")
    assert not (out / "adapters" / "tenant-1").exists()


@pytest.mark.parametrize("mode", ["concurrent"])
def test_sync_versions_are_checked_against_trajectories(mode: str, micro_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / mode
    assert main(_args(micro_model_dir, out, "+tenants=1", f"clora.mode={mode}", "trainer.max_training_steps=3")) == 0
    versions = [r["adapter_version"] for r in _step_metrics(out) if r["event"] == "step"]
    assert versions == [1, 2, 3]


@pytest.mark.parametrize("user", ["scripted", "llm"])
def test_taubench_recipe_end_to_end(user: str, micro_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / f"tau-{user}"
    tenants = "+tenants=2" if user == "scripted" else "+tenants=1"
    assert main([
        f"trainer.policy.model.path={micro_model_dir}", "preset=demo", f"clora.output_dir={out}", "trainer.max_training_steps=1",
        "clora.progress=false", "recipe=taubench", f"recipe.user={user}", tenants, "trainer.train_batch_size=1", "recipe.eval_prompts=1",
        "generator.max_turns=2", "generator.sampling_params.max_generate_length=8",
    ]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert all(row["status"] == "ok" and row["steps"] == 1 for row in summary["per_tenant"])
    steps = [r for r in _step_metrics(out) if r["event"] == "step"]
    for record in steps:  # the benchmark's reward breakdown reaches the metrics
        assert {"rollout/environment/r_actions", "rollout/environment/r_outputs",
                "rollout/environment/turns"} <= set(record)


def test_mini_batches_step_the_optimizer_and_its_schedule_per_mini_batch(learning_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """SkyRL's ``policy_mini_batch_size``: 2 prompts per step in mini-batches of 1 make 2 optimizer steps per RL
    step, and the LR schedule spans every optimizer step of the run (SkyRL's ``num_training_steps``)."""
    import math

    out = tmp_path / "mini"
    lr = 4e-3
    assert main(_args(learning_model_dir, out, micro_tenants({}), "trainer.policy_mini_batch_size=1",
                      "trainer.policy.optimizer_config.scheduler=cosine", f"trainer.policy.optimizer_config.lr={lr}",
                      "trainer.ckpt_interval=1")) == 0
    steps = sorted((r for r in read_records(out) if r["event"] == "step"), key=lambda r: r["step"])
    assert [r["train/optimizer_steps"] for r in steps] == [2.0, 2.0]
    # cosine over 2 RL steps x 2 optimizer steps: each RL step reports the mean LR of its two optimizer steps
    schedule = [lr * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert [r["train/lr"] for r in steps] == pytest.approx([sum(schedule[:2]) / 2, sum(schedule[2:]) / 2])
    state = json.loads((out / "checkpoints" / "tenant-0" / "global_step_2" / "trainer_state.json").read_text())
    assert state["step"] == 4


def test_tenants_whose_trainer_state_does_not_fit_the_host_are_refused_before_any_work(
        micro_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """With host memory for about one and a half tenants' trainer state, two tenants are refused in one line before
    any registers, after the run claimed its output folder: the folder goes again (or, made by the user, keeps only
    what it held); one tenant runs."""
    import skyrl_clora.backends.embedded.backend as backend
    from skyrl_clora.backends.embedded.memory_plan import HOST_STORE_SHARE

    sizes: list[int] = []
    check = backend.check_tenant_host_memory

    def tight(store, ranks: list[int], available: int) -> None:
        sizes.append(store.host_bytes(ranks[0]))
        check(store, ranks, int(1.5 * store.host_bytes(ranks[0]) / HOST_STORE_SHARE))

    monkeypatch.setattr(backend, "check_tenant_host_memory", tight)
    out = tmp_path / "two"
    assert main(_args(micro_model_dir, out, "+tenants=2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "2 tenants need" in err[-1] and "run at most 1 more tenants" in err[-1], err[-1:]
    assert not any(line.startswith("Traceback") for line in err)
    assert not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own file")
    assert main(_args(micro_model_dir, mine, "+tenants=2")) == 2
    assert sorted(path.name for path in mine.iterdir()) == ["notes.txt"]
    assert main(_args(micro_model_dir, tmp_path / "one", "+tenants=1")) == 0
    assert sizes and sizes[0] > 0
