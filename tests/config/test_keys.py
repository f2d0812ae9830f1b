"""SkyRL's keys on both backends: docs/config.md's table is the code's, every SkyRL key of the table reaches the
translated SkyRL config (backend=skyrl) as given, and backend=embedded honours, ignores or refuses each as the
table says."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
from omegaconf import OmegaConf

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.keys import (
    DOC_HEADER, HONOURED, IGNORED, KEY_RULES, REFUSED, SKYRL_RULES, SKYRL_SET, check_embedded_keys, given_keys,
    mapping_table, rule_for,
)
from skyrl_clora.config.compose import check_known_keys, compose_config
from skyrl_clora.backends.skyrl.config_translation import translate

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


@dataclass(frozen=True)
class Sample:
    """A value of a SkyRL key that differs from the default, the overrides it needs beside it, and where the
    embedded run config holds it (None: an ignored or refused key)."""

    key: str
    value: Any
    extra: tuple[str, ...] = ()
    embedded: Callable[[Any], Any] | None = None
    expected: Any = field(default=None)
    added: bool = False  # a key of a SkyRL free-form dict (engine_init_kwargs, ...): given as ++key=value

    def override(self, data: Path, model: Path) -> str:
        if isinstance(self.value, list):
            text = "[" + ",".join(f"'{item}'" for item in self.value) + "]"
        else:
            text = str(self.value).lower() if isinstance(self.value, bool) else str(self.value)
        plus = "++" if self.added else ""
        return f"{plus}{self.key}={text}".replace("{data}", str(data)).replace("{model}", str(model))


SAMPLES = [
    Sample("data.train_data", ["{data}/train.parquet"], ("environment.env_class=gsm8k",),
           lambda run: list(run.recipe.train_data)),
    Sample("data.val_data", ["{data}/validation.parquet"], ("environment.env_class=gsm8k",),
           lambda run: list(run.recipe.val_data)),
    Sample("environment.env_class", "gsm8k", (), lambda run: run.recipe.env_class),
    Sample("trainer.policy.model.path", "{model}", (), lambda run: run.model_path),
    Sample("trainer.policy.model.lora.rank", 8, ("sampler.max_lora_rank=16",), lambda run: run.lora.rank),
    Sample("trainer.policy.model.lora.alpha", 8, (), lambda run: run.lora.alpha),
    Sample("trainer.policy.model.lora.target_modules", "q_proj"),
    Sample("trainer.policy.model.lora.dropout", 0.1),
    Sample("trainer.policy.optimizer_config.lr", 3e-4, (), lambda run: run.trainer.lr),
    Sample("trainer.policy.optimizer_config.weight_decay", 0.05, (), lambda run: run.trainer.weight_decay),
    Sample("trainer.policy.optimizer_config.max_grad_norm", 0.5, (), lambda run: run.trainer.max_grad_norm),
    Sample("trainer.policy.optimizer_config.num_warmup_steps", 2, (), lambda run: run.trainer.num_warmup_steps),
    Sample("trainer.policy.optimizer_config.scheduler", "constant", (), lambda run: run.trainer.scheduler),
    Sample("trainer.policy.optimizer_config.offload_after_step", False),
    Sample("trainer.seed", 7, (), lambda run: run.seed),
    Sample("trainer.epochs", 3, (), lambda run: run.epochs),
    Sample("trainer.max_training_steps", 4, (), lambda run: run.max_training_steps),
    Sample("trainer.train_batch_size", 2, (), lambda run: run.recipe.prompts_per_step),
    Sample("trainer.policy_mini_batch_size", 2, (), lambda run: run.trainer.policy_mini_batch_size),
    Sample("trainer.update_epochs_per_batch", 2, (), lambda run: run.trainer.update_epochs_per_batch),
    Sample("trainer.micro_train_batch_size_per_gpu", 2, (), lambda run: run.trainer.micro_train_batch_size_per_gpu),
    Sample("trainer.max_tokens_per_microbatch", 4096, (), lambda run: run.trainer.max_tokens_per_microbatch),
    Sample("trainer.micro_forward_batch_size_per_gpu", 2),
    Sample("trainer.eval_batch_size", 16),
    Sample("trainer.eval_interval", 3, (), lambda run: run.trainer.eval_interval),
    Sample("trainer.eval_before_train", False, (), lambda run: run.trainer.eval_before_train),
    Sample("trainer.ckpt_interval", 3, (), lambda run: run.trainer.ckpt_interval),
    Sample("trainer.ckpt_path", "{data}/ckpts", (), lambda run: run.trainer.ckpt_path),
    Sample("trainer.max_ckpts_to_keep", 5, (), lambda run: run.trainer.max_ckpts_to_keep),
    Sample("trainer.resume_mode", "none", (), lambda run: run.trainer.resume_mode),
    Sample("trainer.resume_path", "{data}", ("trainer.resume_mode=from_path",), lambda run: run.trainer.resume_path),
    Sample("trainer.logger", "console", (), lambda run: run.trainer.logger, ["console"]),
    Sample("trainer.project_name", "gsm8k", (), lambda run: run.trainer.project_name),
    Sample("trainer.run_name", "gsm8k_test", (), lambda run: run.trainer.run_name),
    Sample("trainer.log_path", "/tmp/skyrl-logs-elsewhere"),
    Sample("trainer.strategy", "megatron"),
    Sample("trainer.placement.policy_num_gpus_per_node", 2),
    Sample("trainer.bf16", False),
    Sample("trainer.gradient_checkpointing", False),
    Sample("trainer.use_expandable_segments", False),
    Sample("trainer.max_prompt_length", 256, (), lambda run: run.recipe.max_input_length),
    Sample("trainer.algorithm.use_kl_loss", True, (), lambda run: run.trainer.algorithm["use_kl_loss"]),
    Sample("trainer.algorithm.use_kl_in_reward", True, (), lambda run: run.trainer.algorithm["use_kl_in_reward"]),
    Sample("trainer.algorithm.dynamic_sampling.type", "filter"),
    Sample("trainer.algorithm.advantage_estimator", "gae"),
    Sample("trainer.algorithm.use_entropy_loss", True),
    Sample("trainer.algorithm.advantage_batch_normalize", True),
    Sample("trainer.algorithm.zero_variance_filter", True),
    Sample("trainer.algorithm.enable_sample_support_replay", True),
    Sample("trainer.algorithm.kl_loss_coef", 0.01, (), lambda run: run.trainer.algorithm["kl_loss_coef"]),
    Sample("trainer.algorithm.loss_reduction", "prompt_mean", (),
           lambda run: run.trainer.algorithm["loss_reduction"]),
    Sample("trainer.algorithm.max_seq_len", 1024, ("trainer.algorithm.loss_reduction=seq_mean_token_sum_norm",),
           lambda run: run.trainer.algorithm["max_seq_len"]),
    Sample("trainer.algorithm.entropy_loss_coef", 0.02),
    Sample("trainer.algorithm.value_clip", 0.3),
    Sample("trainer.algorithm.eps_clip_high", 0.28, (), lambda run: run.trainer.algorithm["eps_clip_high"]),
    Sample("generator.n_samples_per_prompt", 5, (), lambda run: run.recipe.samples_per_prompt),
    Sample("generator.max_turns", 2, (), lambda run: run.recipe.max_turns),
    Sample("generator.max_input_length", 400, (), lambda run: run.recipe.max_input_length),
    Sample("generator.sampling_params.max_generate_length", 30, (), lambda run: run.recipe.max_generate_length),
    Sample("generator.sampling_params.temperature", 0.7, (), lambda run: run.sampler.temperature),
    Sample("generator.sampling_params.top_p", 0.9, (), lambda run: run.sampler.top_p),
    Sample("generator.batched", True),
    Sample("generator.chat_template_kwargs.enable_thinking", False, (),
           lambda run: run.recipe.chat_template_kwargs["enable_thinking"], added=True),
    *(Sample(f"{group}.additional_kwargs.min_p", 0.1, added=True)
      for group in ("generator.sampling_params", "generator.eval_sampling_params")),
    *(Sample(f"{group}.{name}", value) for group in ("generator.sampling_params", "generator.eval_sampling_params")
      for name, value in (("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.1), ("stop", ["</s>"]))),
    Sample("generator.eval_n_samples_per_prompt", 3, (), lambda run: run.evaluation.samples_per_prompt),
    Sample("generator.eval_sampling_params.max_generate_length", 64, (), lambda run: run.evaluation.max_generate_length),
    Sample("generator.eval_sampling_params.temperature", 0.6, (),
           lambda run: run.evaluation.sampling_params["temperature"]),
    Sample("generator.eval_sampling_params.top_p", 0.9, (), lambda run: run.evaluation.sampling_params["top_p"]),
    Sample("generator.eval_sampling_params.logprobs", 0),
    Sample("trainer.policy.model_config_kwargs.attn_implementation", "eager", added=True),
    Sample("generator.inference_engine.engine_init_kwargs.kv_cache_dtype", "fp8", (),
           lambda run: run.sampler.kv_cache_dtype, added=True),
    Sample("generator.inference_engine.enable_prefix_caching", False, (), lambda run: run.sampler.enable_prefix_caching),
    Sample("generator.inference_engine.gpu_memory_utilization", 0.5),
    Sample("generator.inference_engine.max_num_seqs", 64),
    Sample("generator.inference_engine.num_engines", 2),
]
"""One sample per rule of KEY_RULES (a prefix rule by one key under it)."""

# Samples SkyRL's own checks refuse without the other keys they need (what SkyRL says).
SKYRL_REFUSES = {"trainer.algorithm.advantage_estimator": "trainer.critic.model.path",
                 "trainer.algorithm.enable_sample_support_replay": "enable_return_sample_support_set"}

# Keys SkyRL's config receives from the plugin instead (config.keys.SKYRL_SET), with the value each sample gives.
SET_BY_PLUGIN = {"trainer.strategy", "trainer.policy_mini_batch_size"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from skyrl_clora.recipes.skyrl_gsm8k.data import write_skyrl_gsm8k

    folder = tmp_path_factory.mktemp("skyrl-gsm8k")
    write_skyrl_gsm8k(folder, train_size=16, val_size=4, variant="easy")
    return folder


def test_docs_table_is_the_codes() -> None:
    assert DOCS.read_text() == DOC_HEADER + mapping_table() + "\n", "regenerate: python -m skyrl_clora.config.keys"


def test_every_rule_has_a_sample() -> None:
    covered = {rule_for(sample.key).key for sample in SAMPLES}
    assert covered == {rule.key for rule in KEY_RULES}


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.key)
def test_skyrl_key_reaches_skyrls_config_as_given(sample: Sample, data: Path, micro_model_dir: Path,
                                                  tmp_path: Path, without_production_extras: None) -> None:
    overrides = ["backend=skyrl", f"clora.output_dir={tmp_path}", "+tenants=2",
                 *[o.replace("{data}", str(data)) for o in sample.extra], sample.override(data, micro_model_dir)]
    cfg = compose_config(overrides)
    check_known_keys(cfg, overrides)
    given = [o.lstrip("+").split("=", 1)[0] for o in overrides]
    if getattr(rule_for(sample.key, SKYRL_RULES), "action", None) == REFUSED:  # see test_skyrl_driver_refuses_...
        with pytest.raises(ConfigError, match=f"^{sample.key}=.* on backend=skyrl: "):
            translate(cfg, model_path=str(tmp_path), given=given)
        return
    if sample.key in SKYRL_REFUSES:  # the value reaches SkyRL's config, whose own checks reject it alone
        with pytest.raises(ConfigError, match=f"SkyRL rejects the .*config.*: .*{SKYRL_REFUSES[sample.key]}"):
            translate(cfg, model_path=str(tmp_path), given=given)
        return
    plan = translate(cfg, model_path=str(tmp_path), given=given)  # the tiny base's path, were none given
    expected = OmegaConf.select(cfg, sample.key)
    assert expected != OmegaConf.select(compose_config(overrides[:-1]), sample.key)  # the check can fail
    assert expected == OmegaConf.select(OmegaConf.create(_as_dict(plan.base)), sample.key), sample.key
    if sample.key in ("trainer.seed", "trainer.policy.optimizer_config.lr", "generator.n_samples_per_prompt",
                      "environment.env_class"):
        first = next(iter(plan.tenant_configs.values()))
        assert OmegaConf.select(OmegaConf.create(_as_dict(first)), sample.key) == expected  # tenant-0 takes it


def _as_dict(config: Any) -> dict:
    from dataclasses import asdict

    return asdict(config)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.key)
def test_embedded_honours_ignores_or_refuses_each_key(sample: Sample, data: Path, micro_model_dir: Path,
                                                      tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    overrides = [f"clora.output_dir={tmp_path}", *[o.replace("{data}", str(data)) for o in sample.extra],
                 sample.override(data, micro_model_dir)]
    cfg = compose_config(overrides)
    check_known_keys(cfg, overrides)
    rule = rule_for(sample.key)
    try:
        run = build_run_config(cfg)
        refusals = check_embedded_keys(cfg, overrides)
    except ConfigError as error:
        refusals = [str(error)]
    if rule.action == HONOURED:
        assert refusals == []
        expected = sample.expected if sample.expected is not None else OmegaConf.select(cfg, sample.key)
        assert sample.embedded(run) == expected
    elif rule.action == IGNORED:
        assert refusals == [] and sample.key in capsys.readouterr().err
    else:
        assert rule.action == REFUSED and len(refusals) == 1 and "\n" not in refusals[0]
        assert sample.key in refusals[0]


@pytest.mark.parametrize("override", [
    "trainer.algorithm.use_kl_loss=false",
    "trainer.policy.model.lora.target_modules=all-linear", "trainer.policy.model.lora.dropout=0",
    "trainer.algorithm.advantage_estimator=rloo", "trainer.algorithm.use_entropy_loss=false",
])
def test_embedded_runs_a_refusable_key_with_the_value_it_implements(override: str, tmp_path: Path) -> None:
    overrides = [f"clora.output_dir={tmp_path}", override]
    cfg = compose_config(overrides)
    build_run_config(cfg)
    assert check_embedded_keys(cfg, overrides) == []


def test_the_plugin_sets_only_what_it_documents() -> None:
    assert SET_BY_PLUGIN - {"trainer.policy_mini_batch_size"} <= set(SKYRL_SET)


SKYRL_DRIVER_SAMPLES = [
    "trainer.algorithm.dynamic_sampling.type=filter", "trainer.algorithm.zero_variance_filter=true",
    "generator.step_wise_trajectories=true", "generator.merge_stepwise_output=true",
    "trainer.hf_save_interval=5", "trainer.dump_data_batch=true", "trainer.update_ref_every_epoch=true",
    "trainer.critic.model.path=/models/critic", "trainer.export_path=/tmp/exports", "trainer.dump_eval_results=false",
    "trainer.eval_batch_size=16", "trainer.print_example_interval=5", "trainer.log_example_interval=3",
    "trainer.num_logger_eval_samples=2", "trainer.enable_ray_gpu_monitor=false", "trainer.tags=[a]",
    "data.dataloader.num_workers=2",
]
"""One override per rule of SKYRL_RULES, with a value the tenant loop does not run (refused) or any (ignored)."""


def test_every_skyrl_driver_rule_has_a_sample() -> None:
    assert {rule_for(key, SKYRL_RULES).key for key in given_keys(SKYRL_DRIVER_SAMPLES)} == {r.key for r in SKYRL_RULES}


@pytest.mark.parametrize("override", SKYRL_DRIVER_SAMPLES)
def test_skyrl_driver_refuses_or_lists_each_key_it_does_not_act_on(override: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    overrides = ["backend=skyrl", f"clora.output_dir={tmp_path}", "+tenants=2", override]
    cfg = compose_config(overrides)
    check_known_keys(cfg, overrides)
    key = given_keys([override])[0]
    if rule_for(key, SKYRL_RULES).action == IGNORED:
        translate(cfg, model_path=str(tmp_path), given=given_keys(overrides))
        assert f"backend=skyrl ignores {key}" in capsys.readouterr().err
        return
    with pytest.raises(ConfigError) as refused:
        translate(cfg, model_path=str(tmp_path), given=given_keys(overrides))
    assert str(refused.value).startswith(f"{key}=") and "\n" not in str(refused.value)


@pytest.mark.parametrize("override", [
    "trainer.algorithm.dynamic_sampling.max_sample_batches=10", "trainer.algorithm.zero_variance_filter=false",
    "generator.step_wise_trajectories=false", "trainer.hf_save_interval=-1",
    "trainer.critic.model.path=null",
])
def test_skyrl_driver_runs_a_refusable_key_with_the_value_it_implements(override: str, tmp_path: Path) -> None:
    overrides = ["backend=skyrl", f"clora.output_dir={tmp_path}", override]
    translate(compose_config(overrides), model_path=str(tmp_path), given=given_keys(overrides))
