"""skyrl_clora.tenant_loop: the episode batches and metrics records both backends share, and the evaluation, which
follows SkyRL's (``skyrl.train.evaluate``): ``generator.eval_sampling_params`` (SkyRL's default: greedy, at the
training length), ``generator.eval_n_samples_per_prompt`` episodes per row, SkyRL's metric names; and the eval
sampling params a command means are SkyRL's own (``SkyRLTrainConfig.from_cli_overrides``). The loop's checkpoints,
stops and failures are tested with the run (test_checkpoints.py, system/)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from skyrl.train.config import SkyRLTrainConfig

from tests.support.micro_task import micro_tenants, read_records, run_args
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.main import main
from skyrl_clora.config.skyrl_cli import preset_overrides, skyrl_cli_overrides
from skyrl_clora.tenant_loop import episode_batch, eval_record, scalar_reward, step_record


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


def test_an_episode_batch_holds_each_rows_samples_grouped_by_the_tenants_seed() -> None:
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "env_class": "gsm8k", "answer": "2"},
            {"prompt": [{"role": "user", "content": "2+2"}], "env_class": "calc", "answer": "4", "data_source": "x"}]
    batch, ids, groups = episode_batch(7, rows, 3, "train", env_args={"max_turns": 2}, sampling_params={"top_p": 0.5})
    assert groups == ["s7-train-p0"] * 3 + ["s7-train-p1"] * 3
    assert [(i.instance_id, i.repetition_id) for i in ids] == [(g, r % 3) for r, g in enumerate(groups)]
    assert batch["prompts"] == [rows[0]["prompt"]] * 3 + [rows[1]["prompt"]] * 3
    assert batch["env_classes"] == ["gsm8k"] * 3 + ["calc"] * 3
    assert batch["env_extras"][0] == {"answer": "2", "max_turns": 2}
    assert batch["env_extras"][5] == {"answer": "4", "data_source": "x", "max_turns": 2}
    assert batch["sampling_params"] == {"top_p": 0.5} and batch["trajectory_ids"] == ids


def _output(rewards: list[Any], masks: list[list[int]]) -> dict[str, Any]:
    return {"rewards": rewards, "loss_masks": masks, "response_ids": [[1] * len(m) for m in masks],
            "prompt_token_ids": [[1, 2]] * len(masks), "rollout_metrics": {"env/turns": 1.5, "note": "text"}}


def test_a_step_record_counts_rewards_accuracy_and_generated_tokens() -> None:
    output = _output([1.0, [0.0, 0.25], 0.0, [0.5, 0.5]], [[1, 1, 0], [1], [0, 0], [1, 1, 1, 1]])
    record = step_record("a", 3, 4, output, {"rollout_s": 1.5}, {"policy_loss": 0.2})
    assert scalar_reward([0.5, 0.5]) == 1.0 and scalar_reward(0.25) == 0.25
    assert record == {"event": "step", "tenant": "a", "step": 3, "adapter_version": 4, "reward_mean": 2.25 / 4,
                      "accuracy": 0.5, "episodes": 4, "generated_tokens": 7, "rollout_s": 1.5,
                      "train/policy_loss": 0.2, "rollout/env/turns": 1.5}


def test_an_eval_record_scores_every_row_and_each_data_source_as_skyrl_does() -> None:
    rows = [{"data_source": "gsm/a"}, {}]
    output = _output([1.0, 0.0, 0.0, 0.0], [[1]] * 4)
    record = eval_record("b", 0, output, ["p0", "p0", "p1", "p1"], rows, samples=2)
    assert record["event"] == "eval" and record["accuracy"] == 0.25 and record["episodes"] == 4
    assert record["eval/all/avg_score"] == 0.25 and record["eval/all/pass_at_2"] == 0.5
    assert record["eval/gsm_a/avg_score"] == 0.5 and record["eval/gsm_a/pass_at_2"] == 1.0
    assert record["eval/unknown/avg_score"] == 0.0 and record["eval/unknown/pass_at_2"] == 0.0
    assert record["eval/all/env/turns"] == 1.5 and "eval/all/note" not in record
