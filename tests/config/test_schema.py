"""The plugin's configuration dataclasses (:mod:`skyrl_clora.config.schema`): each checks its own values with a
one-line :class:`ConfigError` naming the key and the fix (``checked`` turns a value-type error into one), and a run
reports the steps and sizes derived from its settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.config.schema import ConfigError, RunConfig, checked
from tests.support.two_step_demo_args import two_step_demo_args as _args
@pytest.mark.e2e
def test_unknown_train_mode_is_a_one_line_config_error(micro_model_dir: Path, tmp_path: Path) -> None:
    from skyrl_clora.config.build import build_run_config
    from skyrl_clora.config.compose import compose_config

    with pytest.raises(ConfigError, match=r"clora.train_mode=fused is unknown; use swap or packed"):
        build_run_config(compose_config(_args(micro_model_dir, tmp_path, "clora.train_mode=fused")))
    with pytest.raises(ConfigError, match="clora.pack_size must be >= 0"):
        build_run_config(compose_config(_args(micro_model_dir, tmp_path, "clora.pack_size=-1")))


def _run(tmp_path: Path, *overrides: str) -> RunConfig:
    """The demo run (no model path: the tiny base) with ``overrides``."""
    return build_run_config(compose_config([f"clora.output_dir={tmp_path}", *overrides]))


def test_checked_returns_the_typed_value_or_raises_a_config_error() -> None:
    assert checked(3, float, "trainer.x") == 3.0 and isinstance(checked(3, float, "trainer.x"), float)
    assert checked(None, int | None, "trainer.x") is None
    with pytest.raises(ConfigError, match=r"^trainer.x=abc must be an integer$"):
        checked("abc", int, "trainer.x")


def test_a_runs_derived_sizes_follow_its_settings(tmp_path: Path) -> None:
    run = _run(tmp_path, "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=2",
               "trainer.update_epochs_per_batch=3", "generator.max_input_length=100",
               "generator.sampling_params.max_generate_length=30", "generator.eval_sampling_params.max_generate_length=50",
               "clora.max_tenants=5", "+tenants=2")
    assert run.optimizer_steps_per_rl_step == 4 // 2 * 3
    assert run.max_sequence_length == 100 + 50
    assert run.tenant_capacity == 5 and dataclasses.replace(run, max_tenants=0).tenant_capacity == 2
    with pytest.raises(RuntimeError, match="plan_steps"):
        run.steps


@pytest.mark.parametrize("section, change, message", [
    ("run", dict(mode="parallel"), r"^clora.mode=parallel is unknown; use concurrent or serial$"),
    ("run", dict(mode="serial", backend="skyrl"), r"^backend=skyrl runs tenants concurrently on one stack"),
    ("run", dict(replicas=0), r"^clora.replicas=0 must be >= 1$"),
    ("run", dict(replicas=2, mode="serial"), r"^clora.replicas > 1 spreads a concurrent run of backend=embedded"),
    ("run", dict(device="tpu"), r"^clora.device=tpu is unknown; use auto, cpu or cuda$"),
    ("run", dict(model_dtype="int8"), r"^model.dtype=int8 is unknown"),
    ("run", dict(max_training_steps=0), r"^trainer.max_training_steps must be >= 1 \(or null\), got 0$"),
    ("trainer", dict(ckpt_interval=-1), r"^trainer.ckpt_interval=-1 must be >= 0"),
    ("trainer", dict(max_ckpts_to_keep=0), r"^trainer.max_ckpts_to_keep=0 must be -1 \(all\) or >= 1$"),
    ("trainer", dict(sm_carveout=128), r"^clora.sm_carveout=128 must be in \[0, 128\)"),
    ("trainer", dict(micro_train_batch_size_per_gpu=0), r"^trainer.micro_train_batch_size_per_gpu must be >= 1, got 0$"),
    ("sampler", dict(prefill_block=24), r"^sampler.prefill_block=24 must be a positive multiple of 16$"),
    ("sampler", dict(top_p=0.0), r"top_p in \(0, 1\]$"),
    ("sampler", dict(prefill_wait_steps=-1), r"^sampler.prefill_wait_steps=-1 must be >= 0 \(or null\)$"),
    ("recipe", dict(eval_prompts=-1), r"^recipe.eval_prompts must be >= 0, got -1$"),
    ("recipe", dict(max_turns=0), r"^generator.max_turns must be >= 1, got 0$"),
    ("lora", dict(max_lora_rank=0), r"^sampler.max_lora_rank must be >= 1, got 0$"),
    ("evaluation", dict(samples_per_prompt=0), r"^generator.eval_n_samples_per_prompt must be >= 1, got 0$"),
])
def test_each_dataclass_refuses_a_bad_value_naming_its_key(tmp_path: Path, section: str, change: dict,
                                                            message: str) -> None:
    run = _run(tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        if section == "run":
            dataclasses.replace(run, **change)
        else:
            dataclasses.replace(getattr(run, section), **change)
    assert "\n" not in str(error.value)
    dataclasses.replace(run if section == "run" else getattr(run, section))  # unchanged, it is valid
