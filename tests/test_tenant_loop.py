"""The tenant loop's evaluation follows SkyRL's (``skyrl.train.evaluate``): ``generator.eval_sampling_params`` (SkyRL's default:
greedy, at the training length), ``generator.eval_n_samples_per_prompt`` episodes per row, SkyRL's metric names; and
the eval sampling params a command means are SkyRL's own (``SkyRLTrainConfig.from_cli_overrides``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from skyrl.train.config import SkyRLTrainConfig

from tests.support.micro_task import micro_tenants, read_records, run_args
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.main import main
from skyrl_clora.config.skyrl_cli import preset_overrides, skyrl_cli_overrides


@pytest.mark.parametrize("overrides", [
    [],
    ["generator.sampling_params.max_generate_length=77"],
    ["generator.eval_sampling_params.temperature=0.5"],
    ["generator.eval_sampling_params.top_p=0.9", "generator.eval_sampling_params.max_generate_length=12"],
    ["generator.eval_n_samples_per_prompt=3", "generator.sampling_params.temperature=0.7"],
])
def test_the_eval_sampling_params_a_command_means_are_skyrls(overrides: list[str], tmp_path: Path) -> None:
    """Without an eval_sampling_params key SkyRL evaluates greedily at the training length; with some, SkyRL builds
    its SamplingParams from those alone (the other fields at SamplingParams' defaults)."""
    (tmp_path / "config.json").write_text("{}")
    command = [f"trainer.policy.model.path={tmp_path}", *overrides]  # a model of its own: SkyRL's defaults
    run = build_run_config(compose_config(preset_overrides(skyrl_cli_overrides([*command, f"clora.output_dir={tmp_path}"]))))
    skyrl = SkyRLTrainConfig.from_cli_overrides(command).generator
    assert run.evaluation.sampling_params == asdict(skyrl.eval_sampling_params)
    assert run.evaluation.samples_per_prompt == skyrl.eval_n_samples_per_prompt


def _step0_scores(model: Path, out: Path, *extra: str) -> list[float]:
    tenants = micro_tenants({"name": "a", "seed": 1}, {"name": "b", "seed": 2})
    assert main(run_args(model, out, tenants, "trainer.max_training_steps=1", "trainer.eval_interval=1", *extra)) == 0
    evals = {r["tenant"]: r for r in read_records(out) if r["event"] == "eval" and r["step"] == 0}
    assert all(record["episodes"] == 8 * int(dict(o.split("=") for o in extra).get(
        "generator.eval_n_samples_per_prompt", 1)) for record in evals.values())
    return [evals[name]["eval/all/avg_score"] for name in ("a", "b")]


def test_evaluation_samples_with_the_eval_sampling_params(micro_model_dir: Path, tmp_path: Path) -> None:
    """A fresh adapter (B = 0) is the base model, so two tenants' step-0 evaluations are the same episodes when
    greedy (SkyRL's default) and differ when sampled at temperature 1 (each tenant's requests are seeded by its seed);
    the micro task's reward is a fraction, so equal scores are no coincidence."""
    greedy = _step0_scores(micro_model_dir, tmp_path / "greedy")
    sampled = _step0_scores(micro_model_dir, tmp_path / "sampled", "generator.eval_sampling_params.temperature=1.0",
                            "generator.eval_sampling_params.max_generate_length=8", "generator.eval_n_samples_per_prompt=2")
    assert greedy[0] == greedy[1] and sampled[0] != sampled[1], (greedy, sampled)
