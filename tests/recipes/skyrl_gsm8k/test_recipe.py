"""Tests of ``skyrl_clora.recipes.skyrl_gsm8k.recipe``: SkyRL's own GSM8K recipe, skyrl-gym's single-turn ``gsm8k``
env on SkyRL-format rows. As a plugin: generated rows in SkyRL's format per tenant, or ``data.train_data`` /
``data.val_data`` read unchanged, a loud error should skyrl-gym stop registering ``gsm8k``, and the single-turn
corpus. End to end (``e2e``): SkyRL's example (examples/train/gsm8k/run_gsm8k.sh) run verbatim plus ``+tenants=4``
on the CPU, on both backends: its command's overrides exactly as its shell passes them, with the script's own
variables set (``DATA_DIR`` to data made by ``skyrl_clora.recipes.skyrl_gsm8k.data``, ``NUM_GPUS=1``,
``LOGGER=console``, ``HOME`` a temporary folder) and its hub id ``Qwen/Qwen2.5-1.5B-Instruct`` resolved in a Hugging
Face cache that holds a tiny base pre-trained on the skyrl_gsm8k corpus under that id (an uncached hub id offline
being a one-line error); and SkyRL's ``gsm8k`` env learning on it."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import skyrl_gym

from skyrl_clora.main import main
from skyrl_clora.recipes.gsm8k.problems import save_rows_parquet
from skyrl_clora.recipes.plugin import EVAL_SEED_OFFSET, CorpusSettings, EpisodeEnv, load_recipe, recipe_for_env
from skyrl_clora.recipes.skyrl_gsm8k import corpus
from skyrl_clora.recipes.skyrl_gsm8k.data import make_skyrl_rows, write_skyrl_gsm8k
from skyrl_clora.recipes.skyrl_gsm8k.recipe import RECIPE
from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, ensure_tiny_base
from tests.support.recipe_runs import run_config


RUN_GSM8K = r"""
  data.train_data="['$DATA_DIR/train.parquet']" \
  data.val_data="['$DATA_DIR/validation.parquet']" \
  trainer.algorithm.advantage_estimator="grpo" \
  trainer.policy.model.path="Qwen/Qwen2.5-1.5B-Instruct" \
  trainer.placement.colocate_all=true \
  trainer.strategy=fsdp \
  trainer.placement.policy_num_gpus_per_node=$NUM_GPUS \
  trainer.placement.critic_num_gpus_per_node=$NUM_GPUS \
  trainer.placement.ref_num_gpus_per_node=$NUM_GPUS \
  generator.inference_engine.num_engines=$NUM_GPUS \
  generator.inference_engine.tensor_parallel_size=1 \
  trainer.epochs=20 \
  trainer.eval_batch_size=1024 \
  trainer.eval_before_train=true \
  trainer.eval_interval=5 \
  trainer.update_epochs_per_batch=1 \
  trainer.train_batch_size=1024 \
  trainer.policy_mini_batch_size=256 \
  trainer.micro_forward_batch_size_per_gpu=64 \
  trainer.micro_train_batch_size_per_gpu=64 \
  trainer.ckpt_interval=10 \
  trainer.max_prompt_length=512 \
  generator.sampling_params.max_generate_length=1024 \
  trainer.policy.optimizer_config.lr=1.0e-6 \
  trainer.algorithm.use_kl_loss=true \
  generator.inference_engine.backend=$INFERENCE_BACKEND \
  generator.inference_engine.run_engines_locally=true \
  generator.inference_engine.weight_sync_backend=nccl \
  generator.batched=true \
  environment.env_class=gsm8k \
  generator.n_samples_per_prompt=5 \
  generator.inference_engine.gpu_memory_utilization=0.8 \
  trainer.logger="$LOGGER" \
  trainer.project_name="gsm8k" \
  trainer.run_name="gsm8k_test" \
  trainer.resume_mode=null \
  trainer.log_path="/tmp/skyrl-logs" \
  trainer.ckpt_path="$HOME/ckpts/gsm8k_1.5B_ckpt" \
"""
"""The overrides of run_gsm8k.sh's command, verbatim (its final ``$@`` is the test's own overrides): NovaSky-AI/SkyRL
examples/train/gsm8k/run_gsm8k.sh, blob 43a5180114bc, as of commit 19b0e1328 (2026-07-01) and unchanged through the
skyrl 0.4.0 release (the wheel ships no examples/)."""


HUB_ID = "Qwen/Qwen2.5-1.5B-Instruct"


# Sized for 2 CPU cores: the script's `$@`, overrides appended after its own, as its comment invites.
CPU_SIZE = (
    "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4", "trainer.micro_forward_batch_size_per_gpu=4",
    "trainer.micro_train_batch_size_per_gpu=4", "generator.sampling_params.max_generate_length=24",
    "trainer.max_training_steps=2",
)


def run_gsm8k_overrides(variables: dict[str, str]) -> list[str]:
    """:data:`RUN_GSM8K` as bash passes it to SkyRL's entry point: lines joined at their ``\\``, each ``$NAME`` read
    from ``variables``, quotes removed."""
    text = re.sub(r"\$(\w+)", lambda match: variables[match.group(1)], RUN_GSM8K.replace("\\\n", " "))
    return shlex.split(text)


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


@pytest.fixture
def hub_cache(small_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face hub cache holding ``small_base`` as the snapshot of :data:`HUB_ID`, the hub offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-hub"
    revision = "0" * 40
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(small_base, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / revision


def script_line(data: Path, home: Path) -> list[str]:
    """run_gsm8k.sh's overrides with ``NUM_GPUS=1 LOGGER=console`` (the script's own switches) and its paths."""
    return run_gsm8k_overrides({"DATA_DIR": str(data), "NUM_GPUS": "1", "LOGGER": "console", "INFERENCE_BACKEND": "vllm",
                                "HOME": str(home)})


@pytest.mark.e2e
def test_an_uncached_hub_id_offline_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main([f"trainer.policy.model.path={HUB_ID}", f"clora.output_dir={tmp_path / 'out'}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: trainer.policy.model.path={HUB_ID} is neither a local "
                                                     "folder nor in the Hugging Face cache"), errors
    assert f"hf download {HUB_ID}" in errors[0] and not (tmp_path / "out").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["embedded", "skyrl"])
def test_skyrls_gsm8k_script_runs_four_tenants(backend: str, data: Path, hub_cache: Path, tmp_path: Path,
                                               without_production_extras: None) -> None:
    out = tmp_path / "run"
    args = [*script_line(data, tmp_path), *CPU_SIZE, "+tenants=4", f"backend={backend}", f"clora.output_dir={out}",
            "clora.progress=false"]
    assert main(args) == 0
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
    assert (tmp_path / "ckpts" / "gsm8k_1.5B_ckpt" / "tenant-0").is_dir()  # trainer.ckpt_path as given
    adapter = json.loads((out / "adapters" / "tenant-0" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] in (HUB_ID, str(hub_cache))


@pytest.mark.e2e
def test_skyrls_gsm8k_env_learns_on_a_tiny_base(data: Path, small_base: Path, tmp_path: Path) -> None:
    """Ten GRPO steps lift the held-out accuracy of SkyRL's gsm8k env (the tiny base answers in the '####' format
    about a third of the time before RL)."""
    out = tmp_path / "learn"
    args = [f"trainer.policy.model.path={small_base}", "preset=demo", "environment.env_class=gsm8k", f"clora.output_dir={out}",
            f"data.train_data=['{data}/train.parquet']", f"data.val_data=['{data}/validation.parquet']",
            "trainer.max_training_steps=10", "+tenants=2", "clora.progress=false"]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accuracy = {(r["tenant"], r["step"]): r["accuracy"] for r in records if r["event"] == "eval"}
    start = sum(accuracy[(t, 0)] for t in ("tenant-0", "tenant-1")) / 2
    final = sum(accuracy[(t, 10)] for t in ("tenant-0", "tenant-1")) / 2
    assert start <= 0.5 and final >= max(0.6, start + 0.25), accuracy


def test_the_recipe_serves_skyrl_gyms_gsm8k_env_on_generated_skyrl_rows(tmp_path: Path) -> None:
    run = run_config(tmp_path, "environment.env_class=gsm8k", "+tenants=[{seed:3,task_variant:easy}]", "trainer.seed=5",
                     "recipe.eval_prompts=4")
    assert recipe_for_env("gsm8k") == run.recipe.name == "skyrl_gsm8k" and load_recipe("skyrl_gsm8k") is RECIPE
    source = RECIPE.task_source(run.recipe, run.tenants[0], None, run.seed)
    assert source.train_rows == make_skyrl_rows(64, seed=3, variant="easy", split="train")
    assert source.eval_rows == make_skyrl_rows(4, seed=5 + EVAL_SEED_OFFSET, variant="easy", split="test")
    assert source.env_classes() == {"gsm8k"} and source.seed == 3


def test_data_files_are_read_unchanged(tmp_path: Path) -> None:
    rows = [{**row, "ability": "math"} for row in make_skyrl_rows(3, seed=1)]  # a column the recipe does not use
    train = save_rows_parquet(rows, tmp_path / "train.parquet")
    run = run_config(tmp_path, "environment.env_class=gsm8k", f"data.train_data=['{train}']")
    source = RECIPE.task_source(run.recipe, run.tenants[0], None, 0)
    assert source.train_rows == rows
    assert len(source.eval_rows) == run.recipe.eval_prompts  # generated: no data.val_data


def test_a_skyrl_gym_without_gsm8k_is_a_loud_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = run_config(tmp_path, "environment.env_class=gsm8k")
    monkeypatch.delitem(skyrl_gym.registry, "gsm8k")
    with pytest.raises(RuntimeError, match="skyrl-gym no longer registers 'gsm8k'"):
        RECIPE.task_source(run.recipe, run.tenants[0], None, 0)


def test_episodes_refusals_and_corpus(tmp_path: Path) -> None:
    run = run_config(tmp_path, "environment.env_class=gsm8k")
    assert RECIPE.env_classes == ("gsm8k",) and RECIPE.episode_env(run.recipe, run.tenants[0], None) == EpisodeEnv()
    assert RECIPE.refuses(run.recipe, "embedded") is None and RECIPE.refuses(run.recipe, "skyrl") is None
    settings = CorpusSettings(count=5, hard_fraction=0.0, seed=2)
    assert RECIPE.pretraining_episodes(settings, 0.5) == corpus.pretraining_episodes(settings, 0.5)
