"""The Hydra config with backend=skyrl translated into SkyRL's SkyRLTrainConfig, checked by SkyRL's validate_cfg."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from skyrl.train.utils.utils import validate_cfg

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.config.keys import given_keys
from skyrl_clora.config.compose import compose_config
from skyrl_clora.backends.skyrl.config_translation import translate, why_workers_cannot_run

REAL_FIND_SPEC = importlib.util.find_spec  # before the fixture below hides vllm and megatron

pytestmark = pytest.mark.usefixtures("without_production_extras")


def _translate(tmp_path: Path, *overrides: str):
    args = ["backend=skyrl", f"trainer.policy.model.path={tmp_path}", *overrides]
    return translate(compose_config(args), given=given_keys(args))


@pytest.mark.parametrize("tenants", [1, 2, 8])
def test_gsm8k_translation_passes_skyrls_validate_cfg(tmp_path: Path, tenants: int) -> None:
    plan = _translate(tmp_path, f"+tenants={tenants}", "recipe=gsm8k")
    base = plan.base
    assert len(plan.tenant_configs) == tenants == len(plan.tenants)
    assert base.trainer.strategy == "fsdp" and base.generator.inference_engine.backend == "vllm"  # SkyRL's default
    lora = base.trainer.policy.model.lora
    assert lora.rank == 16 and lora.alpha == 32 and lora.max_loras == tenants and lora.max_cpu_loras == tenants
    assert base.trainer.policy.megatron_config.lora_config.merge_lora is False
    assert base.trainer.policy.model.path == str(tmp_path)
    assert base.environment.env_class == "gsm8k_calc"
    assert base.generator.max_turns == 3 and base.generator.n_samples_per_prompt == 4
    assert base.generator.sampling_params.max_generate_length == 40
    seeds = {name: st.trainer.seed for name, st in plan.tenant_configs.items()}
    assert seeds == {f"tenant-{i}": i for i in range(tenants)}
    for st in [base, *plan.tenant_configs.values()]:
        validate_cfg(st)  # SkyRL's own check, again, on the returned objects


def test_per_tenant_hyper_parameters_reach_their_configs(tmp_path: Path) -> None:
    plan = _translate(tmp_path, "+tenants=[{lr:1e-3},{lr:3e-3,seed:7,samples_per_prompt:8}]")
    first, second = plan.tenant_configs.values()
    assert first.trainer.policy.optimizer_config.lr == 1e-3 and second.trainer.policy.optimizer_config.lr == 3e-3
    assert second.trainer.seed == 7 and second.generator.n_samples_per_prompt == 8
    assert first.generator.n_samples_per_prompt == 4


def test_serial_mode_needs_one_lora_slot_per_batch(tmp_path: Path) -> None:
    plan = _translate(tmp_path, "+tenants=4", "clora.mode=serial", "trainer.policy.model.lora.max_loras=1")
    assert plan.tenants_per_batch == 1 and plan.base.trainer.policy.model.lora.max_loras == 1


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["trainer.policy.model.lora.rank=0"], "trainer.policy.model.lora.rank=0 turns LoRA off"),
        (["+tenants=[{rank:0},{}]"], "turns LoRA off"),
        (["backend.inference_backend=sglang"], "serves LoRA adapters with vllm only"),
        (["trainer.policy.megatron_config.lora_config.merge_lora=true"], "merges one adapter into the shared base weights"),
        (["+tenants=8", "trainer.policy.model.lora.max_loras=4"], "trainer.policy.model.lora.max_loras=4 < 8 tenants sampling in one batch"),
        (["+tenants=[{rank:8,alpha:16},{}]"], "tenants differ in LoRA signature"),
        (["+tenants=[{alpha:8},{}]"], "tenants differ in LoRA signature"),
        (["+tenants=2", "trainer.policy.model.lora.max_cpu_loras=1"], "adapters would be evicted"),
        (["trainer.policy.optimizer_config.scheduler=cosine", "trainer.strategy=megatron"],
         "Megatron scheduler is constant with linear warm-up"),
        (["trainer.policy.optimizer_config.scheduler=cosine", "backend.strategy=embedded", "trainer.strategy=megatron"],
         "embedded stands in for megatron"),
        (["trainer.policy.optimizer_config.scheduler=cosine", "backend.strategy=megatron"], "Megatron scheduler"),
        (["backend.strategy=megatron", "trainer.strategy=fsdp"],
         "trainer.strategy=fsdp names other workers than backend.strategy=megatron"),
        (["backend.strategy=fsdp2", "trainer.strategy=megatron"], "names other workers than backend.strategy=fsdp2"),
        (["trainer.strategy=deepspeed"], "trainer.strategy=deepspeed is not one of SkyRL 0.4's"),
        (["backend.strategy=deepspeed"], "backend.strategy=deepspeed is unknown"),
        (["backend=embedded"], "use backend=skyrl"),
        (["recipe=taubench", "recipe.user=llm"], "use recipe.user=scripted with backend=skyrl"),
        (["trainer.train_batch_size=3", "trainer.placement.policy_num_gpus_per_node=8", "generator.n_samples_per_prompt=1"],
         "SkyRL rejects the translated config (shared)"),
    ],
)
def test_invalid_combinations_fail_with_one_line_reasons(tmp_path: Path, overrides: list[str], reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _translate(tmp_path, *overrides)
    message = str(caught.value)
    assert reason in message and "\n" not in message


@pytest.mark.parametrize("strategy", ["backend.strategy=fsdp2", "trainer.strategy=fsdp", "trainer.strategy=fsdp2"])
def test_fsdp_takes_the_cosine_schedule(tmp_path: Path, strategy: str) -> None:
    plan = _translate(tmp_path, strategy, "trainer.policy.optimizer_config.scheduler=cosine")
    assert plan.base.trainer.policy.optimizer_config.scheduler == "cosine" and plan.base.trainer.strategy == "fsdp"


@pytest.mark.parametrize(("given", "production"), [
    ((), "fsdp2"), (("trainer.strategy=fsdp",), "fsdp2"), (("trainer.strategy=fsdp2",), "fsdp2"),
    (("trainer.strategy=megatron",), "megatron"), (("backend.strategy=fsdp2",), "fsdp2"),
    (("backend.strategy=megatron", "trainer.strategy=megatron"), "megatron"),
])
def test_trainer_strategy_names_the_workers(tmp_path: Path, given: tuple[str, ...], production: str) -> None:
    """SkyRL's trainer.strategy (fsdp by default; fsdp2 its alias) names the policy workers: backend.strategy=auto
    runs them where this machine can (here, no GPU and no megatron: the embedded stand-in, which keeps SkyRL's
    value in the config it validates); backend.strategy may name the same workers."""
    plan = _translate(tmp_path, "+tenants=2", *given)
    assert plan.base.trainer.strategy == {"fsdp2": "fsdp", "megatron": "megatron"}[production]
    explicit = any(g.startswith("backend.strategy=") for g in given)
    assert plan.strategy == (production if explicit else "embedded")


def test_stand_ins_keep_the_production_values_in_skyrls_config(tmp_path: Path) -> None:
    """auto picks the embedded stand-ins here (no vllm, no megatron, no GPU); SkyRL still validates vllm and the
    workers trainer.strategy names."""
    plan = _translate(tmp_path, "+tenants=2", "trainer.strategy=megatron")
    assert (plan.inference_backend, plan.strategy) == ("embedded", "embedded")
    assert plan.base.generator.inference_engine.backend == "vllm" and plan.base.trainer.strategy == "megatron"
    assert [line.split(" -> ")[0] for line in plan.substitutions] == [
        "generator.inference_engine.backend=vllm", "trainer.strategy=megatron"]
    explicit = _translate(tmp_path, "backend.inference_backend=vllm", "backend.strategy=megatron")
    assert (explicit.inference_backend, explicit.strategy, explicit.substitutions) == ("vllm", "megatron", ())
    assert plan.base.trainer.policy.model.lora.lora_sync_path == os.path.abspath("outputs/run/lora_sync")


@pytest.fixture
def megatron_core_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, without_production_extras: None):
    """A machine where megatron-core imports (a package ``megatron.core`` on the path) and Megatron-Bridge and
    TransformerEngine do not: ``find_spec`` sees the real path again. Returns the folder on the path."""
    site = tmp_path / "site"
    (site / "megatron" / "core").mkdir(parents=True)
    (site / "megatron" / "__init__.py").write_text("")
    (site / "megatron" / "core" / "__init__.py").write_text("")
    monkeypatch.setattr(importlib.util, "find_spec", REAL_FIND_SPEC)
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in [name for name in sys.modules if name.split(".")[0] in ("megatron", "vllm")]:
        del sys.modules[name]


def test_auto_runs_the_stand_in_when_megatron_core_imports_but_megatron_bridge_does_not(
        tmp_path: Path, megatron_core_only: Path) -> None:
    """backend.strategy=auto with trainer.strategy=megatron: megatron-core alone does not run SkyRL's Megatron worker
    (it imports Megatron-Bridge and TransformerEngine), so the embedded stand-in runs, and its substitution line says
    why; with vllm importable too and the Megatron workers named, the run is refused naming the missing packages."""
    assert importlib.util.find_spec("megatron.core") is not None and importlib.util.find_spec("megatron") is not None
    plan = _translate(tmp_path, "+tenants=2", "trainer.strategy=megatron")
    assert plan.strategy == "embedded" and plan.base.trainer.strategy == "megatron"
    line = plan.substitutions[-1]
    assert line.startswith("trainer.strategy=megatron -> ") and "\n" not in line
    assert "backend.strategy=auto: SkyRL's Megatron worker imports megatron.bridge, transformer_engine" in line
    from skyrl_clora.backends.skyrl.stack import check_buildable

    (megatron_core_only / "vllm").mkdir()
    (megatron_core_only / "vllm" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    assert _translate(tmp_path, "trainer.strategy=megatron").strategy == "embedded"
    explicit = _translate(tmp_path, "backend.inference_backend=vllm", "backend.strategy=megatron")
    with pytest.raises(ConfigError, match="Megatron worker imports megatron.bridge, transformer_engine, not importable"):
        check_buildable(explicit)


def test_why_the_production_workers_cannot_run_here() -> None:
    """No vllm, no megatron, no GPU on this machine: each worker kind names what it lacks first."""
    assert why_workers_cannot_run("megatron", "vllm") == ("SkyRL's Megatron worker imports megatron.core, "
                                                          "megatron.bridge, transformer_engine, not importable here")
    assert why_workers_cannot_run("fsdp2", "embedded") == "SkyRL's FSDP2 worker needs a CUDA GPU; none is visible"


def test_a_base_model_is_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a base model folder"):
        translate(compose_config(["backend=skyrl"]))
    plan = translate(compose_config(["backend=skyrl"]), model_path=str(tmp_path))
    assert plan.base.trainer.policy.model.path == str(tmp_path)


def test_the_token_budget_of_micro_batches_reaches_skyrls_config(tmp_path: Path) -> None:
    plan = _translate(tmp_path, "+tenants=2", "trainer.max_tokens_per_microbatch=4096")
    assert plan.base.trainer.max_tokens_per_microbatch == 4096
    assert {c.trainer.max_tokens_per_microbatch for c in plan.tenant_configs.values()} == {4096}
    assert _translate(tmp_path).base.trainer.max_tokens_per_microbatch == -1


@pytest.mark.parametrize(("given", "train", "forward"), [
    ((), 16, 16),  # SkyRL's 1 for the forward would recompute log-probs one sequence at a time
    (("trainer.micro_train_batch_size_per_gpu=8",), 8, 8),
    (("trainer.micro_forward_batch_size_per_gpu=4",), 16, 4),
    (("trainer.micro_train_batch_size_per_gpu=8", "trainer.micro_forward_batch_size_per_gpu=1"), 8, 1),
])
def test_the_forward_micro_batch_is_the_training_ones_unless_given(tmp_path: Path, given: tuple[str, ...], train: int,
                                                                   forward: int) -> None:
    plan = _translate(tmp_path, "+tenants=2", "trainer.policy_mini_batch_size=4", "generator.n_samples_per_prompt=4",
                      *given)
    for config in (plan.base, *plan.tenant_configs.values()):
        assert (config.trainer.micro_train_batch_size_per_gpu, config.trainer.micro_forward_batch_size_per_gpu) == (
            train, forward)


def test_the_policy_temperature_is_the_sampling_temperature_unless_given(tmp_path: Path) -> None:
    """SkyRL's rule (``SkyRLTrainConfig.__post_init__``): ``trainer.algorithm.temperature`` null takes
    ``generator.sampling_params.temperature``; a given one is kept."""
    plan = _translate(tmp_path, "+tenants=2", "generator.sampling_params.temperature=0.5")
    assert {st.trainer.algorithm.temperature for st in [plan.base, *plan.tenant_configs.values()]} == {0.5}
    given = _translate(tmp_path, "generator.sampling_params.temperature=0.5", "trainer.algorithm.temperature=0.7")
    assert given.base.trainer.algorithm.temperature == 0.7


@pytest.mark.parametrize("temperature", [0.5, 1.0, 0.0])
def test_vllm_reports_the_tempered_log_probs_away_from_temperature_1(tmp_path: Path, temperature: float) -> None:
    """vLLM's default log-probs are the raw model's; at a temperature other than 1 (or greedy 0) the translation asks
    for the tempered ones (``logprobs_mode=processed_logprobs``, which SkyRL passes to vLLM's engine args)."""
    plan = _translate(tmp_path, "+tenants=2", f"generator.sampling_params.temperature={temperature}")
    expected = {"logprobs_mode": "processed_logprobs"} if temperature == 0.5 else {}
    for st in [plan.base, *plan.tenant_configs.values()]:
        assert st.generator.inference_engine.engine_init_kwargs == expected


def test_another_vllm_logprobs_mode_away_from_temperature_1_is_refused(tmp_path: Path) -> None:
    raw = "+generator.inference_engine.engine_init_kwargs.logprobs_mode=raw_logprobs"
    with pytest.raises(ConfigError, match=r"^generator.inference_engine.engine_init_kwargs.logprobs_mode=raw_logprobs "
                                          r"with generator.sampling_params.temperature=0.5: .*drop it"):
        _translate(tmp_path, "generator.sampling_params.temperature=0.5", raw)
    assert _translate(tmp_path, raw).base.generator.inference_engine.engine_init_kwargs == {"logprobs_mode": "raw_logprobs"}
