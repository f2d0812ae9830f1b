"""The run shell: :func:`prepare`'s phases refuse bad input in order, each before anything is built or written, and
:func:`run_pool` runs a prepared run through the one summary every backend shares."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import skyrl_clora.base_model as base_model
import skyrl_clora.checkpoints as checkpoints
from tests.support.micro_task import micro_tenants, read_records, run_args
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.run_shell import prepare, run_pool

TWO = micro_tenants({"name": "a", "seed": 1}, {"name": "b", "seed": 2})


@pytest.mark.parametrize(("args", "phase_says"), [
    (["clora.bogus=1"], "unknown key clora.bogus"),  # 1: composing
    (["trainer.policy.model.lora.dropout=0.1"], "trainer.policy.model.lora.dropout"),  # 2: the backend's refusals
    (["trainer.train_batch_size=100", "data.train_data=[{data}/train.parquet]"],  # 3: the task data
     "the training data holds 64 rows, fewer than trainer.train_batch_size=100"),
])
def test_each_phase_refuses_before_a_model_is_built_or_a_folder_made(args: list[str], phase_says: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from skyrl_clora.recipes.skyrl_gsm8k.data import write_skyrl_gsm8k

    def built(*args, **kwargs):
        raise AssertionError("the base model was resolved or the folder claimed before the refusal")

    monkeypatch.setattr(base_model, "resolve_model_path", built)
    monkeypatch.setattr(checkpoints, "claim_output_dir", built)
    write_skyrl_gsm8k(tmp_path / "data", train_size=64, val_size=4)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=re.escape(phase_says)):
        prepare([*(arg.replace("{data}", str(tmp_path / "data")) for arg in args), f"clora.output_dir={out}"])
    assert not out.exists()


def test_prepare_plans_the_steps_claims_the_folder_and_run_pool_summarizes(micro_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepared = prepare(run_args(micro_model_dir, out, TWO, steps=2))
    assert prepared.run.steps == 2 and prepared.plan is None and prepared.resume == {} and prepared.stopped == []
    assert sorted(prepared.sources) == ["a", "b"]
    assert out.is_dir() and prepared.before_claim is None, "the claim made the folder that was not there"
    summary = run_pool(prepared)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert [row["tenant"] for row in summary["per_tenant"]] == ["a", "b"]
    assert all(row["status"] == "ok" for row in summary["per_tenant"])
    assert summary["wall_seconds"] > 0 and summary["mode"] == "concurrent"
    steps = [record for record in read_records(out) if record["event"] == "step"]
    assert sorted((record["tenant"], record["step"]) for record in steps) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
