"""skyrl_clora.backends.engine_builder: the sampler's engine as both backends build it. Each ``sampler.*`` key, given
on the command line, builds the same engine on ``backend=embedded`` (``build_services``) and on ``backend=skyrl``
with the embedded server (``stack.serving_engine``), key by key; the pieces (rows, slots, KV cache dtype and blocks,
prefill wait, the engine config's per-device choices) from the settings they read."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from skyrl_clora.backends.embedded.services import build_services
from skyrl_clora.backends.engine_builder import (GPU_PREFILL_WAIT_STEPS, engine_config, engine_kv_blocks, engine_rows,
                                                 engine_slot_count, kv_cache_dtype, prefill_wait_steps, step_rows)
from skyrl_clora.backends.skyrl.stack import serving_engine
from skyrl_clora.config.schema import SamplerConfig
from skyrl_clora.run_shell import check_backend, compose_run

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

KEY_CASES = {
    "temperature": "generator.sampling_params.temperature=0.7",
    "top_p": "generator.sampling_params.top_p=0.8",
    "max_rows": "sampler.max_rows=40",
    "max_prefills_per_step": "sampler.max_prefills_per_step=3",
    "prefill_block": "sampler.prefill_block=48",
    "enable_prefix_caching": "generator.inference_engine.enable_prefix_caching=false",
    "cuda_graphs": "sampler.cuda_graphs=false",
    "gpu_memory_utilization": "sampler.gpu_memory_utilization=0.5",
    "kv_blocks": "sampler.kv_blocks=77",
    "reuse_decode_kv": "sampler.reuse_decode_kv=true",
    "prefill_wait_steps": "sampler.prefill_wait_steps=5",
    "stream_priority": "sampler.stream_priority=normal",
    "adapter_slots": "sampler.adapter_slots=2",
    "admission": "sampler.admission=fifo",
    "reserve_kv": "sampler.reserve_kv=false",
    "kv_cache_dtype": "+generator.inference_engine.engine_init_kwargs.kv_cache_dtype=fp8",
}
"""One command-line key per ``sampler.*`` field, set away from its default (conf/config.yaml's)."""

GPU_ONLY = {"gpu_memory_utilization"}
"""Keys whose only reader is the GPU's memory plan (``engine_kv_blocks``' ``gpu_plan``), tested below with a GPU
device's plan stood in for."""


def _sampler(**settings: Any) -> SimpleNamespace:
    """``sampler.*`` as the config leaves it (the nulls: chosen per device), with ``settings``."""
    defaults = dict(max_rows=0, max_prefills_per_step=4, prefill_block=16, enable_prefix_caching=True,
                    cuda_graphs=True, kv_blocks=0, reuse_decode_kv=None, stream_priority="normal",
                    prefill_wait_steps=None, admission="fair", reserve_kv=False, adapter_slots=None,
                    kv_cache_dtype="auto")
    return SimpleNamespace(**(defaults | settings))


def _engines(model: Path, tmp_path: Path, key: str | None) -> dict[str, Any]:
    """The engine each backend builds for three tenants with ``key`` given (None: the defaults), as
    ``{backend: (EngineConfig, adapter slots, the requests' temperature and top_p)}``."""
    built = {}
    for backend in ("embedded", "skyrl"):
        argv = [f"trainer.policy.model.path={model}", f"clora.output_dir={tmp_path / backend}", "+tenants=3",
                f"backend={backend}", "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2", "trainer.logger=[console]",
                "generator.n_samples_per_prompt=4",
                *([key] if key else [])]
        cfg, run, given = compose_run(argv)
        if backend == "embedded":
            services = build_services(run, str(model), len(run.tenants), step_rows(run, run.tenants))
            engine, sampling = services.engine, services.client.default_sampling
        else:
            plan = check_backend(cfg, run, argv, given)

            def held_elsewhere(model: torch.nn.Module, max_len: int) -> int:
                raise AssertionError("the GPU's memory plan was asked for on the CPU")

            engine = serving_engine(run, list(plan.tenants), str(model), held_elsewhere)
            sampling = dataclasses.asdict(plan.tenant_configs[plan.tenants[0].name].generator.sampling_params)
        try:
            built[backend] = (engine.engine.config, engine.engine.adapters.count,
                              (sampling["temperature"], sampling["top_p"]))
        finally:
            engine.shutdown()
    return built


@pytest.mark.parametrize("field", sorted(KEY_CASES))
def test_each_sampler_key_builds_the_same_engine_on_both_backends(field: str, micro_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    assert {f.name for f in dataclasses.fields(SamplerConfig)} == set(KEY_CASES), "a sampler.* field without a case"
    defaults = _engines(micro_model_dir, tmp_path / "defaults", None)
    given = _engines(micro_model_dir, tmp_path / "given", KEY_CASES[field])
    assert given["embedded"] == given["skyrl"], KEY_CASES[field]
    assert defaults["embedded"] == defaults["skyrl"]
    if field not in GPU_ONLY:
        assert given["embedded"] != defaults["embedded"], f"{KEY_CASES[field]} changed nothing on the CPU"


def test_rows_are_every_tenants_step_batch_or_max_rows_in_whole_quanta() -> None:
    tenants = [SimpleNamespace(samples_per_prompt=4), SimpleNamespace(samples_per_prompt=6)]
    assert step_rows(SimpleNamespace(recipe=SimpleNamespace(prompts_per_step=3)), tenants) == 18
    assert engine_rows(_sampler(), 2, 18) == 48 and engine_rows(_sampler(), 1, 16) == 16
    assert engine_rows(_sampler(max_rows=20), 8, 18) == 32


def test_the_kv_cache_dtype_is_the_models_or_e4m3() -> None:
    assert kv_cache_dtype(_sampler()) is None
    assert kv_cache_dtype(_sampler(kv_cache_dtype="fp8")) is kv_cache_dtype(_sampler(kv_cache_dtype="fp8_e4m3")) \
        is torch.float8_e4m3fn


def test_a_null_prefill_wait_is_the_gpus_default_on_a_gpu_and_none_on_the_cpu() -> None:
    assert (prefill_wait_steps(_sampler(), CUDA), prefill_wait_steps(_sampler(), CPU)) == (GPU_PREFILL_WAIT_STEPS, 0)
    assert GPU_PREFILL_WAIT_STEPS > 0
    for given in (0, 3):
        assert prefill_wait_steps(_sampler(prefill_wait_steps=given), CUDA) == given
        assert prefill_wait_steps(_sampler(prefill_wait_steps=given), CPU) == given


def test_the_engine_has_a_slot_per_tenant_unless_fewer_are_asked_for() -> None:
    assert engine_slot_count(_sampler(), 6) == 6
    assert engine_slot_count(_sampler(adapter_slots=2), 6) == 2
    assert engine_slot_count(_sampler(adapter_slots=10), 6) == 6


def test_kv_blocks_are_the_given_ones_else_the_gpus_plan_else_the_hosts(micro_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir)
    plans: list[str] = []

    def gpu_plan() -> int:
        plans.append("asked")
        return 123

    def run(**settings: Any) -> SimpleNamespace:
        return SimpleNamespace(sampler=_sampler(**settings))

    assert engine_kv_blocks(run(kv_blocks=50), model, CUDA, 16, 64, gpu_plan) == 50 and plans == []
    assert engine_kv_blocks(run(), model, CUDA, 16, 64, gpu_plan) == 123 and plans == ["asked"]
    assert engine_kv_blocks(run(), model, CPU, 16, 64, gpu_plan) is None, "the host holds every row at full length"
    assert plans == ["asked"]


@pytest.mark.parametrize(("device", "reuse", "expected"), [
    (CPU, None, (False, False, 0)), (CUDA, None, (True, True, GPU_PREFILL_WAIT_STEPS)),
    (CPU, True, (True, False, 0)), (CUDA, False, (False, True, GPU_PREFILL_WAIT_STEPS)),
])
def test_the_engine_config_makes_the_devices_choices_for_the_nulls(device: torch.device, reuse: bool | None,
                                                                   expected: tuple[bool, bool, int]) -> None:
    config = engine_config(SimpleNamespace(sampler=_sampler(reuse_decode_kv=reuse)), device, rows=16, max_len=40,
                           kv_blocks=30)
    assert (config.reuse_decode_kv, config.share_prefix_reads, config.prefill_wait_steps) == expected
    assert (config.num_rows, config.max_len, config.num_blocks, config.block_size) == (16, 40, 30, 16)
    assert (config.max_prefills_per_step, config.stream_priority, config.admission) == (4, "normal", "fair")
    assert config.cache_prefixes and config.cuda_graphs and not config.reserve_kv and config.kv_dtype is None
