"""trainer.logger: each tenant's metrics reach SkyRL's Tracking backends (TensorBoard read back with its own reader,
wandb offline), beside metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from micro_task import micro_tenants, read_records, run_args
from skyrl_clora.main import main


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
        for tag in ("reward_mean", "train/policy_loss", "train/grad_norm", "rollout_s", "eval/accuracy"):
            assert tag in scalars, (name, tag)
        steps = [r for r in records if r["tenant"] == name and r["event"] == "step"]
        logged = events.Scalars("reward_mean")
        assert [e.step for e in logged] == [r["step"] for r in steps]
        assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in steps], rel=1e-6)
        assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 3]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
