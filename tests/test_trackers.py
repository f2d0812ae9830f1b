"""trainer.logger: each tenant's metrics reach SkyRL's Tracking backends (TensorBoard read back with its own reader,
wandb offline), beside metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.micro_task import micro_tenants, read_records, run_args
from skyrl_clora.main import main

pytestmark = pytest.mark.e2e


def test_each_tenants_metrics_reach_tensorboard_and_wandb_offline(learning_model_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tenants = micro_tenants({"name": "a", "seed": 1}, {"name": "b", "seed": 2})
    assert main(run_args(learning_model_dir, tmp_path, tenants, "trainer.logger=[tensorboard,wandb,console]")) == 0
    records = read_records(tmp_path)
    for name in ("a", "b"):
        events = EventAccumulator(str(tmp_path / "tensorboard" / name))
        events.Reload()
        scalars = events.Tags()["scalars"]
        for tag in ("reward_mean", "train/policy_loss", "train/grad_norm", "rollout_s", "eval/accuracy",
                    "eval/all/avg_score", "eval/all/pass_at_1"):
            assert tag in scalars, (name, tag)
        steps = [r for r in records if r["tenant"] == name and r["event"] == "step"]
        logged = events.Scalars("reward_mean")
        assert [e.step for e in logged] == [r["step"] for r in steps]
        assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in steps], rel=1e-6)
        assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 3]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_wandb_without_a_key_is_refused_before_anything_loads(micro_model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """SkyRL's default logger is wandb: with no API key, no netrc entry and no offline mode, the run stops in one line
    naming the fixes (exit 2, nothing written), not after the model is loaded; offline mode or a key lets it through."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "run"
    args = run_args(micro_model_dir, out, micro_tenants({"name": "a", "seed": 1}), "trainer.logger=[wandb]")
    assert main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: trainer.logger includes wandb") and "WANDB_MODE=offline" in error
    assert not out.exists()  # nothing written, not even the folder
    from skyrl_clora.config.build import build_run_config
    from skyrl_clora.config.compose import compose_config
    from skyrl_clora.trackers import check_trackers

    run = build_run_config(compose_config(args))
    for variable, value in (("WANDB_MODE", "offline"), ("WANDB_API_KEY", "k" * 40)):
        with monkeypatch.context() as scoped:
            scoped.setenv(variable, value)
            check_trackers(run)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    monkeypatch.delenv("NETRC")
    check_trackers(run)
