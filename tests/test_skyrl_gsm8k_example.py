"""SkyRL's own GSM8K example (examples/train/gsm8k/run_gsm8k.sh: its keys and values) plus ``+tenants=4`` on the
CPU, on both backends, with the data made by ``skyrl_clora.recipes.skyrl_gsm8k.data`` and a tiny base pre-trained on
the skyrl_gsm8k corpus; and SkyRL's ``gsm8k`` env learning on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_clora.main import main
from skyrl_clora.recipes.skyrl_gsm8k.data import write_skyrl_gsm8k
from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, ensure_tiny_base

# SkyRL's run_gsm8k.sh with NUM_GPUS=1, LOGGER=console, INFERENCE_BACKEND=vllm; {data}, {model}, {ckpt} filled in.
SKYRL_EXAMPLE = (
    "data.train_data=['{data}/train.parquet']", "data.val_data=['{data}/validation.parquet']",
    "trainer.algorithm.advantage_estimator=grpo", "trainer.policy.model.path={model}",
    "trainer.placement.colocate_all=true", "trainer.strategy=fsdp", "trainer.placement.policy_num_gpus_per_node=1",
    "trainer.placement.critic_num_gpus_per_node=1", "trainer.placement.ref_num_gpus_per_node=1",
    "generator.inference_engine.num_engines=1", "generator.inference_engine.tensor_parallel_size=1",
    "trainer.epochs=20", "trainer.eval_batch_size=1024", "trainer.eval_before_train=true", "trainer.eval_interval=5",
    "trainer.update_epochs_per_batch=1", "trainer.train_batch_size=1024", "trainer.policy_mini_batch_size=256",
    "trainer.micro_forward_batch_size_per_gpu=64", "trainer.micro_train_batch_size_per_gpu=64",
    "trainer.ckpt_interval=10", "trainer.max_prompt_length=512", "generator.sampling_params.max_generate_length=1024",
    "trainer.policy.optimizer_config.lr=1.0e-6", "trainer.algorithm.use_kl_loss=true",
    "generator.inference_engine.backend=vllm", "generator.inference_engine.run_engines_locally=true",
    "generator.inference_engine.weight_sync_backend=nccl", "generator.batched=true", "environment.env_class=gsm8k",
    "generator.n_samples_per_prompt=5", "generator.inference_engine.gpu_memory_utilization=0.8",
    "trainer.logger=console", "trainer.project_name=gsm8k", "trainer.run_name=gsm8k_test", "trainer.resume_mode=null",
    "trainer.log_path=/tmp/skyrl-logs", "trainer.ckpt_path={ckpt}",
)
# Sized for 2 CPU cores (the script's `$@` overrides, appended after it as SkyRL's own script allows).
CPU_SIZE = (
    "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4", "trainer.micro_forward_batch_size_per_gpu=4",
    "trainer.micro_train_batch_size_per_gpu=4", "generator.sampling_params.max_generate_length=24",
    "trainer.max_training_steps=2", "recipe.eval_prompts=4",
)
# backend=skyrl's multi-tenant constraints: in-place syncs need separate placement, each request its adapter, and
# several tenants Megatron's AdapterStore (here its embedded stand-in).
SKYRL_MULTI_TENANT = ("trainer.placement.colocate_all=false", "generator.batched=false", "trainer.strategy=megatron")

SMALL_BASE = TinyBaseRecipe(corpus="skyrl_gsm8k", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                            head_dim=32, intermediate_size=192, vocab_size=512, num_traces=1500, steps=400,
                            prior_steps=60, batch_size=32, lr=5e-3)
"""A smaller tiny base on the skyrl_gsm8k corpus, pre-trained in well under a minute on 2 cores."""


@pytest.fixture(scope="module")
def small_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_base(tmp_path_factory.mktemp("cache"), SMALL_BASE)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gsm8k")
    write_skyrl_gsm8k(folder, train_size=64, val_size=16, variant="easy")
    return folder


def example(data: Path, model: Path, out: Path, *more: str) -> list[str]:
    keys = [arg.format(data=data, model=model, ckpt=out / "ckpts") for arg in SKYRL_EXAMPLE]
    return [*keys, *CPU_SIZE, *more, "+tenants=4", f"clora.output_dir={out}", "clora.progress=false"]


def test_the_example_needs_only_documented_changes(data: Path, small_base: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture, without_production_extras: None) -> None:
    """On backend=skyrl each of the example's single-adapter settings is refused in one line naming it (on the
    embedded backend it runs as SkyRL writes it: the next test)."""
    for left_out in SKYRL_MULTI_TENANT:
        kept = [fix for fix in SKYRL_MULTI_TENANT if fix != left_out]
        assert main(example(data, small_base, tmp_path / "s", "backend=skyrl", *kept)) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        key = left_out.split("=")[0]
        assert len(errors) == 1 and f"{key}=" in errors[0], (left_out, errors)


@pytest.mark.parametrize("backend", ["embedded", "skyrl"])
def test_skyrls_gsm8k_example_runs_four_tenants(backend: str, data: Path, small_base: Path, tmp_path: Path,
                                                 without_production_extras: None) -> None:
    out = tmp_path / "run"
    extra = (f"backend={backend}", *(SKYRL_MULTI_TENANT if backend == "skyrl" else ()))
    assert main(example(data, small_base, out, *extra)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r["tenant"], r["step"]) for r in records if r["event"] == "step")
    assert steps == [(f"tenant-{i}", s) for i in range(4) for s in (1, 2)]
    assert all(r["episodes"] == 20 and r["train/lr"] == 1e-6 for r in records if r["event"] == "step")
    evals = [r for r in records if r["event"] == "eval"]
    assert sorted((r["tenant"], r["step"]) for r in evals) == [(f"tenant-{i}", s) for i in range(4) for s in (0, 2)]
    rewards = [r["accuracy"] for r in records if r["event"] in ("step", "eval")]
    assert 0 < max(rewards), "skyrl-gym's gsm8k env never rewarded an answer: the '####' format is not reaching it"
    summary = json.loads((out / "summary.json").read_text())
    assert summary.get("backend", "embedded") == backend and [row["status"] for row in summary["per_tenant"]] == ["ok"] * 4
    assert (out / "ckpts" / "tenant-0").is_dir()  # trainer.ckpt_path as given


def test_skyrls_gsm8k_env_learns_on_a_tiny_base(data: Path, small_base: Path, tmp_path: Path) -> None:
    """Ten GRPO steps lift the held-out accuracy of SkyRL's gsm8k env (the tiny base answers in the '####' format
    about a third of the time before RL)."""
    out = tmp_path / "learn"
    args = [f"trainer.policy.model.path={small_base}", "environment.env_class=gsm8k", f"clora.output_dir={out}",
            f"data.train_data=['{data}/train.parquet']", f"data.val_data=['{data}/validation.parquet']",
            "recipe.eval_prompts=16", "trainer.max_training_steps=10", "+tenants=2", "clora.progress=false"]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = {(r["tenant"], r["step"]): r["accuracy"] for r in records if r["event"] == "eval"}
    start = sum(accuracy[(t, 0)] for t in ("tenant-0", "tenant-1")) / 2
    final = sum(accuracy[(t, 10)] for t in ("tenant-0", "tenant-1")) / 2
    assert start <= 0.5 and final >= max(0.6, start + 0.25), accuracy
