"""Building a run from the composed config (:mod:`skyrl_clora.config.build`) as the entry point does: tenants
expanded from ``+tenants`` (a count or a list of overrides), steps planned from the training rows, SkyRL's KL
options and the KV-cache dtype reaching both backends, and bad input (values, files, folders, several groups at
once) refused before any work in one line per problem with exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.config.compose import compose_config
from skyrl_clora.main import main
from skyrl_clora.tenants import expand_tenants


def test_plus_tenants_expands_into_specs(tmp_path: Path) -> None:
    run = build_run_config(compose_config(["+tenants=8", f"clora.output_dir={tmp_path}", "trainer.seed=3"]))
    assert [spec.name for spec in run.tenants] == [f"tenant-{i}" for i in range(8)]
    assert [spec.seed for spec in run.tenants] == list(range(3, 11))
    assert {spec.rank for spec in run.tenants} == {16} and {spec.lr for spec in run.tenants} == {2e-3}


def test_tenant_list_form_with_overrides(tmp_path: Path) -> None:
    run = build_run_config(compose_config([
        "+tenants=[{seed:7,lr:1e-3},{rank:8,alpha:16,task_variant:hard,samples_per_prompt:2,name:small}]",
        f"clora.output_dir={tmp_path}",
    ]))
    first, second = run.tenants
    assert (first.seed, first.lr, first.rank) == (7, 1e-3, 16)
    assert (second.name, second.rank, second.alpha, second.task_variant, second.samples_per_prompt) == (
        "small", 8, 16.0, "hard", 2)


def test_steps_are_read_only_once_planned_from_the_training_rows(tmp_path: Path) -> None:
    run = build_run_config(compose_config([f"clora.output_dir={tmp_path}", "trainer.train_batch_size=4",
                                           "trainer.epochs=2", "trainer.max_training_steps=null"]))
    with pytest.raises(RuntimeError, match="plan_steps"):
        run.steps
    assert plan_steps(run, train_rows=10).steps == 4  # SkyRL's dataloader drops the partial batch: 2 epochs x 2


def test_default_is_one_tenant(tmp_path: Path) -> None:
    assert len(build_run_config(compose_config([f"clora.output_dir={tmp_path}"])).tenants) == 1


@pytest.mark.parametrize("value", [0, -1, "x", [], [{"nope": 1}], [3]])
def test_expand_tenants_rejects_malformed(value) -> None:
    with pytest.raises(ValueError):
        expand_tenants(value, seed=0, lr=1e-3, rank=8, alpha=16, task_variant="standard", samples_per_prompt=4)


@pytest.mark.parametrize("args, needle", [
    (["recipe=nope"], "choose recipe= one of"),
    (["backend=nope"], "choose backend= one of"),
    (["+tenants=0"], "at least 1 tenant"),
    (["+tenants=abc"], "malformed"),
    (["tenants=3"], "+tenants=N"),
    (["trainer.policy.model.path=/does/not/exist"], "trainer.policy.model.path"),
    (["+tenants=[{rank:128}]"], "sampler.max_lora_rank"),
    (["+tenants=[{rank:0}]"], "tenant tenant-0: rank=0 must be positive; set trainer.policy.model.lora.rank or the "
                              "tenant's rank override"),
    (["trainer.policy.optimizer_config.lr=-1"], "lr=-1.0 must be positive; set trainer.policy.optimizer_config.lr"),
    (["+tenants=[{samples_per_prompt:0}]"], "samples_per_prompt=0 must be positive; set generator.n_samples_per_prompt"),
    (["generator.n_samples_per_prompt=0"], "generator.n_samples_per_prompt must be >= 1, got 0"),
    (["trainer.micro_train_batch_size_per_gpu=1.5"], "trainer.micro_train_batch_size_per_gpu=1.5 must be an integer"),
    (["trainer.max_tokens_per_microbatch=0"], "trainer.max_tokens_per_microbatch=0 must be -1 (micro-batches of"),
    (["generator.sampling_params.temperature=warm"], "generator.sampling_params.temperature=warm must be a number"),
    (["sampler.max_lora_rank=abc"], "sampler.max_lora_rank=abc must be an integer"),
    (["recipe.task_variant=[a,b]"], "recipe.task_variant=['a', 'b'] must be a single value"),
    (["trainer.seed=abc"], "trainer.seed=abc must be an integer"),
    (["environment.env_class=null"], "environment.env_class=None has no recipe here and is not registered with "
                                     "skyrl-gym; use one of gsm8k (skyrl_gsm8k)"),
    (["environment.env_class=aime"], "environment.env_class=aime has no recipe with synthetic problems here; give "
                                     "data.train_data="),
    (["trainer.max_training_steps=2.5"], "trainer.max_training_steps=2.5 must be an integer"),
    (["trainer.epochs=0"], "trainer.epochs must be >= 1, got 0"),
    (["clora.progress=maybe"], "clora.progress=maybe must be true or false"),
    (["+tenants=[{rank:1.5}]"], "tenant 0: rank=1.5 must be an integer"),
    (["+tenants=[{name:../escape}]"], "tenant 0: name='../escape' must be letters, digits"),
    (["+tenants=[{name:..}]"], "tenant 0: name='..' must be letters, digits"),
    (["trainer.policy.model.lora.alpha=0"], "tenant tenant-0: alpha=0.0 must be positive; set trainer.policy.model.lora.alpha"),
    (["sampler.max_rows=-5"], "sampler.max_rows=-5 must be >= 0"),
    (["sampler.max_prefills_per_step=0"], "sampler.max_prefills_per_step=0 must be >= 1"),
    (["sampler.kv_blocks=-5"], "sampler.kv_blocks=-5 must be >= 0"),
    (["clora.pack_policy=fifo"], "clora.pack_policy=fifo is unknown; use ready or lockstep"),
    (["clora.train_priority=shortest"], "clora.train_priority=shortest is unknown; use arrival or fewest_updates"),
    (["backend=skyrl", "clora.train_priority=fewest_updates"], "clora.train_priority=fewest_updates needs backend=embedded"),
    (["clora.pack_policy=lockstep"], "clora.pack_policy=lockstep forms packed passes; it needs clora.train_mode=packed"),
    (["sampler.gpu_memory_utilization=1.5"], "sampler.gpu_memory_utilization=1.5 must be in (0, 1)"),
    (["+tenants=[{},{env_class:nope}]"], "tenant tenant-1: env_class=nope is not a registered skyrl-gym environment"),
    (["+tenants=[{task_variant:nope}]"], "tenant tenant-0: unknown gsm8k task variant 'nope'; choose one of standard, hard"),
    (["data.train_data=[/tmp]"], "data.train_data: /tmp: gsm8k parquet file not found: /tmp; point it at a parquet file"),
    (["data.train_data=[/nonexistent.parquet]"], "data.train_data: /nonexistent.parquet does not exist"),
    (["data.val_data=[1]"], "data.val_data=[1] must be a list of parquet files"),
    (["recipe=taubench", "recipe.data_path=/tmp"], "recipe.data_path=/tmp: "),
    (["recipe=taubench", "data.train_data=[/tmp]"], "tau-bench reads its tasks from recipe.data_path"),
    (["+tenants=[{},{lr:fast}]"], "tenant 1: lr=fast must be a number"),
    (["clora.output_dir=/proc/forbidden"], "not writable"),
    (["clora.mode=parallel"], "concurrent or serial"),
    (["clora.shared_prompts=sometimes"], "clora.shared_prompts"),
    (["sampler.reuse_decode_kv=2"], "sampler.reuse_decode_kv"),
    (["sampler.stream_priority=urgent"], "sampler.stream_priority"),
    (["sampler.adapter_slots=0"], "sampler.adapter_slots=0 must be >= 1 (or null: one per tenant)"),
    (["sampler.admission=random"], "sampler.admission=random is unknown; use fifo or fair"),
    (["clora.overlap_sampling=sometimes"], "clora.overlap_sampling=sometimes must be true, false or null"),
    (["backend=skyrl", "clora.overlap_sampling=false"], "clora.overlap_sampling=false needs backend=embedded"),
    (["+clora.foo=1"], "unknown key clora.foo; valid keys here: control, device, max_tenants, mode, output_dir, "
                       "overlap_sampling, pack_policy, pack_size"),
    (["+model.foo=1"], "unknown key model.foo; valid keys here: corpus, dtype"),
    (["model.corpus=taubench"], "model.corpus=taubench is no recipe with a pre-training corpus; use one of gsm8k, "
                                "skyrl_gsm8k"),
    (["recipe=taubench", "recipe.user=bogus"], "recipe.user=bogus is unknown; use scripted or llm"),
    (["recipe=taubench", "recipe.data_path=/nonexistent"], "recipe.data_path=/nonexistent does not exist"),
    (["+recipe.user=llm"], "unknown key recipe.user"),
    (["+backend.foo=1"], "unknown key backend.foo; valid keys here: name"),
    (["backend=skyrl", "+backend.foo=1"], "unknown key backend.foo; valid keys here: inference_backend, name, strategy"),
    (["+trainer.algorithm.foo=1"], "unknown key trainer.algorithm.foo; valid keys here: advantage_batch_normalize, "
                                         "advantage_estimator"),
    (["+foo=1"], "unknown key foo; valid keys: backend, clora, data, environment, generator, model, recipe, sampler, "
                 "trainer"),
    (["clora.outptu_dir=3"], "unknown key clora.outptu_dir; did you mean clora.output_dir"),
    (["trainer.epoch=3"], "unknown key trainer.epoch; did you mean trainer.epochs"),
    (["trainer.algorithm.advantage_estimator=nope"], "trainer.algorithm.advantage_estimator=nope is not in SkyRL's registry"),
    (["trainer.algorithm.policy_loss_type=nope"], "trainer.algorithm.policy_loss_type=nope is not in SkyRL's registry"),
    (["trainer.algorithm.eps_clip_low=abc"], "trainer.algorithm.eps_clip_low=abc must be a number"),
    (["trainer.policy.optimizer_config.scheduler=linear"], "trainer.policy.optimizer_config.scheduler=linear is not "
                                                           "implemented here; use constant_with_warmup or constant or cosine"),
    (["trainer.update_epochs_per_batch=0"], "trainer.update_epochs_per_batch must be >= 1, got 0"),
    (["trainer.policy_mini_batch_size=3"], "trainer.policy_mini_batch_size=3 must divide trainer.train_batch_size=4"),
    (["trainer.critic.model.path=/x"], "trainer.critic.model.path is a SkyRL key backend=embedded does not implement"),
    (["trainer.train_batch_size=100", "data.train_data=[{data}/train.parquet]"],
     "the training data holds 64 rows, fewer than trainer.train_batch_size=100"),
    (["+tenants=[{name:''}]"], "tenant 0: name='' must be letters, digits"),
    (["+tenants=[{use_kl_loss:true}]"], "tenant 0: use_kl_loss is not a per-tenant override (every tenant of the run "
                                        "shares it); set trainer.algorithm.use_kl_loss for the run"),
    (["+tenants=[{advantage_estimator:gae}]"], "tenant tenant-0: advantage_estimator=gae: gae needs a critic"),
    (["+tenants=[{advantage_estimator:nope}]"], "tenant tenant-0: trainer.algorithm.advantage_estimator=nope is not "
                                                "in SkyRL's registry"),
    (["+tenants=[{eps_clip_low:-1}]"], "tenant tenant-0: eps_clip_low=-1.0 must be >= 0"),
    (["backend=skyrl", "+tenants=[{temperature:0.5}]"], "tenant tenant-0: the override temperature needs "
                                                        "backend=embedded"),
    (["trainer.logger=[tensorboard,mlflow]"], "trainer.logger=mlflow is unknown"),
    (["trainer.resume_mode=sometimes"], "trainer.resume_mode=sometimes is unknown"),
    (["trainer.resume_mode=from_path"], "trainer.resume_path goes with trainer.resume_mode=from_path"),
    (["clora.max_tenants=-1"], "clora.max_tenants=-1 must be >= 0"),
    (["clora.step_style=verl"], "clora.step_style=verl is unknown; use skyrl"),
    (["trainer.algorithm.kl_estimator_type=k9"], "trainer.algorithm.kl_estimator_type=k9 is unknown; use one of k1"),
    (["trainer.algorithm.use_kl_in_reward=true", "trainer.algorithm.use_kl_loss=true"],
     "trainer.algorithm.use_kl_in_reward and use_kl_loss are mutually exclusive"),
    (["trainer.algorithm.use_kl_in_reward=true", "trainer.algorithm.kl_ctrl.type=adaptive",
      "trainer.algorithm.kl_ctrl.horizon=0"], "trainer.algorithm.kl_ctrl: horizon must be larger than 0. Got 0"),
    (["backend=skyrl", "trainer.algorithm.use_kl_in_reward=true", "trainer.algorithm.kl_ctrl.type=adaptive"],
     "trainer.algorithm.kl_ctrl.type=adaptive keeps a KL controller per tenant on backend=embedded only"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture,
                                          tmp_path: Path) -> None:
    out = tmp_path / "out"
    if not any(arg.startswith("clora.output_dir=") for arg in args):
        args = [*args, f"clora.output_dir={out}"]
    if any("{data}" in arg for arg in args):
        from skyrl_clora.recipes.skyrl_gsm8k.data import write_skyrl_gsm8k

        write_skyrl_gsm8k(tmp_path / "data", train_size=64, val_size=4)
        args = [arg.replace("{data}", str(tmp_path / "data")) for arg in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()  # refused: nothing written, not even the folder


@pytest.fixture
def bad_files(tmp_path: Path) -> Path:
    """A 0-byte parquet file, a parquet file of the wrong columns, one with no rows, and a model folder whose
    config.json is empty."""
    import pandas as pd

    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "empty.parquet").write_bytes(b"")
    pd.DataFrame({"question": ["1+1?"]}).to_parquet(folder / "shape.parquet")
    pd.DataFrame({"question": [], "answer": []}).to_parquet(folder / "norows.parquet")
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("args, needle", [
    (["data.train_data=[{bad}/empty.parquet]"], "data.train_data: {bad}/empty.parquet: "),
    (["data.train_data=[{bad}/shape.parquet]"], "data.train_data: {bad}/shape.parquet: "),
    (["data.train_data=[{bad}/norows.parquet]"], "data.train_data=['{bad}/norows.parquet'] holds no rows"),
    (["data.val_data=[{bad}/norows.parquet]"], "data.val_data=['{bad}/norows.parquet'] holds no rows"),
    (["environment.env_class=gsm8k", "data.train_data=[{bad}/shape.parquet]"],
     "data.train_data: {bad}/shape.parquet: row 0 has no chat prompt"),
    (["trainer.policy.model.path={bad}/model"], "trainer.policy.model.path={bad}/model is not a usable Hugging Face"),
])
def test_bad_files_are_refused_before_any_work(args: list[str], needle: str, bad_files: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert main([arg.format(bad=bad_files) for arg in args] + [f"clora.output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle.format(bad=bad_files) in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_every_groups_problem_is_listed_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["trainer.policy.model.lora.rank=abc", "trainer.policy.model.lora.alpha=big",
            "generator.sampling_params.temperature=warm", "trainer.algorithm.advantage_estimator=nope",
            "trainer.epochs=x", f"clora.output_dir={tmp_path / 'out'}"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: trainer.policy.model.lora.rank=abc must be an integer",
        "error: trainer.policy.model.lora.alpha=big must be a number",
        "error: trainer.algorithm.advantage_estimator=nope is not in SkyRL's registry; use one of gae, grpo, maxrl, "
        "reinforce++, rloo (or register yours with SkyRL before the run)",
        "error: generator.sampling_params.temperature=warm must be a number",
        "error: trainer.epochs=x must be an integer",
    ]


def test_bad_input_from_the_command_line_has_no_traceback() -> None:
    result = subprocess.run([sys.executable, "-m", "skyrl_clora.main", "+tenants=0"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error:") and "Traceback" not in result.stderr


@pytest.mark.parametrize("backend", ["embedded", "skyrl"])
def test_skyrls_kl_options_and_the_step_style_reach_both_backends(backend: str, tmp_path: Path) -> None:
    """``use_kl_loss`` and its coefficient and estimator reach the AlgorithmConfig the trainer is built with (the
    embedded services' and the translated SkyRL config's); ``clora.step_style`` defaults to SkyRL's step."""
    from skyrl.train.config import AlgorithmConfig

    from skyrl_clora.backends.skyrl.config_translation import translate

    overrides = [f"backend={backend}", f"clora.output_dir={tmp_path}", "trainer.algorithm.use_kl_loss=true",
                 "trainer.algorithm.kl_loss_coef=0.05", "trainer.algorithm.kl_estimator_type=k1"]
    run = build_run_config(compose_config(overrides))
    assert run.trainer.step_style == "skyrl"
    algorithm = (translate(compose_config([*overrides, f"trainer.policy.model.path={tmp_path}"])).base.trainer.algorithm
                 if backend == "skyrl" else AlgorithmConfig(**run.trainer.algorithm))
    assert (algorithm.use_kl_loss, algorithm.kl_loss_coef, algorithm.kl_estimator_type) == (True, 0.05, "k1")
    assert build_run_config(compose_config([*overrides, "clora.step_style=tinker"])).trainer.step_style == "tinker"


@pytest.mark.parametrize("value,expected", [(None, None), ("auto", None), ("fp8", "float8_e4m3fn"),
                                            ("fp8_e4m3", "float8_e4m3fn")])
def test_kv_cache_dtype_picks_the_engines_cache_dtype(value: str | None, expected: str | None, tmp_path: Path) -> None:
    """SkyRL's ``engine_init_kwargs.kv_cache_dtype`` reaches the embedded engine (``engine_builder.kv_cache_dtype``, what
    both backends hand the Engine and the memory plan); absent, the model's dtype."""
    import torch

    from skyrl_clora.backends.engine_builder import kv_cache_dtype

    given = [] if value is None else [f"+generator.inference_engine.engine_init_kwargs.kv_cache_dtype={value}"]
    run = build_run_config(compose_config([f"clora.output_dir={tmp_path}", *given]))
    assert kv_cache_dtype(run.sampler) == (None if expected is None else getattr(torch, expected))


def test_an_unsupported_kv_cache_dtype_is_one_line(tmp_path: Path) -> None:
    from skyrl_clora.config.schema import ConfigError

    cfg = compose_config([f"clora.output_dir={tmp_path}", "+generator.inference_engine.engine_init_kwargs.kv_cache_dtype=fp8_e5m2"])
    with pytest.raises(ConfigError, match=r"^generator.inference_engine.engine_init_kwargs.kv_cache_dtype=fp8_e5m2 is not "
                                          r"supported by the embedded engine; use auto, fp8, fp8_e4m3 \(") as error:
        build_run_config(cfg)
    assert "\n" not in str(error.value)


def test_an_fp8_kv_block_takes_half_the_bytes() -> None:
    """The memory plan's block size follows the cache dtype: an fp8 cache gets twice the blocks."""
    import torch
    from transformers import Qwen3Config

    from skyrl_clora.backends.embedded.memory_plan import kv_block_bytes

    config = Qwen3Config(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    wide = kv_block_bytes(config, 16, torch.bfloat16)
    assert wide == 2 * 28 * 8 * 16 * 128 * 2
    assert kv_block_bytes(config, 16, torch.float8_e4m3fn) * 2 == wide
