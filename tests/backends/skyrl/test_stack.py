"""The shared part of the backend=skyrl stack (skyrl_clora.backends.skyrl.stack), without Ray: the plans this machine
cannot build are refused before anything starts, each in one line with its fix (Megatron beside the embedded server,
vLLM or Megatron's packages missing, colocated vLLM, an embedded worker on several GPUs, too few GPUs, FSDP2 without
flash-attn or with a sync other than disk); and what :class:`SkyRLStack` does for the driver: the server's version of a
tenant, a step's metrics per worker strategy, a resumed tenant's adapter loaded as its version, a failed tenant's
adapter unloaded once its requests are done, and one shutdown of everything it started."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from skyrl.train.config import SkyRLTrainConfig

import skyrl_clora.backends.skyrl.stack as stack_module
from skyrl_clora.backends.skyrl.stack import SkyRLStack, check_buildable, check_fsdp_buildable
from skyrl_clora.config.schema import ConfigError


def _plan(strategy: str, inference_backend: str, **placement: Any) -> SimpleNamespace:
    """A plan of SkyRL's default config (one vLLM engine of one GPU) with ``placement`` (colocate_all off)."""
    base = SkyRLTrainConfig()
    base.trainer.placement.colocate_all = False
    for key, value in placement.items():
        setattr(base.trainer.placement, key, value)
    return SimpleNamespace(strategy=strategy, inference_backend=inference_backend, base=base)


def _importable_but(*missing: str) -> Callable[[str], bool]:
    """``config_translation.importable`` on a machine where only ``missing`` cannot be imported."""
    return lambda module: module not in missing


@pytest.mark.parametrize(("plan", "missing", "reason"), [
    (_plan("megatron", "embedded"), (), "^backend.strategy=megatron needs backend.inference_backend=vllm"),
    (_plan("embedded", "vllm"), ("vllm",), "^backend.inference_backend=vllm but vllm is not installed"),
    (_plan("megatron", "vllm"), ("megatron.bridge", "transformer_engine"),
     "^backend.strategy=megatron but SkyRL's Megatron worker imports megatron.bridge, transformer_engine, not "),
    (_plan("embedded", "embedded", colocate_all=True), (), r"^trainer.placement.colocate_all=true sleeps the vLLM"),
    (_plan("embedded", "embedded", policy_num_gpus_per_node=2), (), "^backend.strategy=embedded runs one worker"),
], ids=["megatron-beside-the-embedded-server", "no-vllm", "no-megatron", "colocated", "embedded-on-two-gpus"])
def test_a_plan_this_machine_cannot_build_is_refused_with_its_fix(
        monkeypatch: pytest.MonkeyPatch, plan: SimpleNamespace, missing: tuple[str, ...], reason: str) -> None:
    monkeypatch.setattr(stack_module, "importable", _importable_but(*missing))
    with pytest.raises(ConfigError, match=reason):
        check_buildable(plan)


def test_the_gpus_a_plan_needs_are_counted_only_when_it_runs_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both halves embedded need no GPU; vLLM's engines need theirs (engines x TP x PP x DP), Megatron's workers
    theirs on top: refused while fewer are visible, built once they are."""
    monkeypatch.setattr(stack_module, "importable", _importable_but())
    visible = {"count": 0}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible["count"])
    check_buildable(_plan("embedded", "embedded"))
    vllm = _plan("embedded", "vllm")
    vllm.base.generator.inference_engine.num_engines = 2
    vllm.base.generator.inference_engine.tensor_parallel_size = 2
    megatron = _plan("megatron", "vllm", policy_num_gpus_per_node=3)
    for plan, needed in ((vllm, 4), (megatron, 4)):
        visible["count"] = needed - 1
        with pytest.raises(ConfigError, match=f"needs {needed} GPUs \\(not colocated\\); {needed - 1} visible"):
            check_buildable(plan)
        visible["count"] = needed
        check_buildable(plan)


@pytest.mark.parametrize(("setting", "missing", "reason"), [
    ({}, ("flash_attn",), "^backend.strategy=fsdp2: SkyRL's FSDP model wrapper imports flash_attn.bert_padding"),
    ({"flash_attn": True}, (), "^trainer.flash_attn/remove_microbatch_padding need flash-attn, which is not installed"),
    ({"sync_mode": "nccl"}, (), "^backend.strategy=fsdp2 syncs each tenant's adapter through disk"),
])
def test_fsdp2_on_a_gpu_needs_flash_attn_and_the_disk_sync(monkeypatch: pytest.MonkeyPatch, setting: dict,
                                                           missing: tuple[str, ...], reason: str) -> None:
    import transformers.utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(stack_module, "importable", _importable_but(*missing))
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    plan = _plan("fsdp2", "embedded")
    trainer = plan.base.trainer
    trainer.flash_attn = trainer.remove_microbatch_padding = False
    trainer.flash_attn = setting.get("flash_attn", False)
    trainer.policy.model.lora.sync_mode = setting.get("sync_mode", "disk")
    with pytest.raises(ConfigError, match=reason):
        check_fsdp_buildable(plan)
    trainer.flash_attn, trainer.policy.model.lora.sync_mode = False, "disk"
    monkeypatch.setattr(stack_module, "importable", _importable_but())
    check_fsdp_buildable(plan)


@dataclass
class _Stats:
    decode_steps: int = 3
    generated_tokens: int = 40


class _Engine:
    """What the stack reads of its embedded engine: versions, stats, publishes (recorded); and its shutdown."""

    def __init__(self) -> None:
        self.stats = _Stats()
        self.published: list[tuple[str, Any, int]] = []
        self.shutdowns = 0

    def adapter_version(self, tenant: str) -> int:
        return {"t": 4}[tenant]

    def publish(self, tenant: str, weights: Any, version: int) -> concurrent.futures.Future:
        self.published.append((tenant, weights, version))
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(None)
        return future

    def shutdown(self) -> None:
        self.shutdowns += 1


class _Client:
    """The inference client's LoRA calls: loads recorded; unloads answer from ``unload_answers`` in turn (an
    exception is raised)."""

    def __init__(self, unload_answers: list[Exception | None] | None = None) -> None:
        self.loaded: list[tuple[str, str]] = []
        self.unload_answers = list(unload_answers or [])
        self.unloads = 0

    async def load_lora_adapter(self, tenant: str, path: str) -> None:
        self.loaded.append((tenant, path))

    async def unload_lora_adapter(self, tenant: str) -> None:
        self.unloads += 1
        answer = self.unload_answers.pop(0) if self.unload_answers else None
        if answer is not None:
            raise answer


class _View:
    def __init__(self) -> None:
        self.resumed: list[int] = []

    def resume_weight_version(self, version: int) -> None:
        self.resumed.append(version)


class _Stoppable:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1

    def shutdown(self) -> None:
        self.stops += 1


def _stack(strategy: str = "megatron", engine: _Engine | None = None, client: _Client | None = None,
           **fields: Any) -> SkyRLStack:
    """A stack of ``strategy`` workers (none started) with one tenant view, ``t``; the embedded server's ``engine``
    (None: vLLM)."""
    return SkyRLStack(tokenizer=None, client=client or _Client(), views={"t": _View()},
                      policy_group=SimpleNamespace(actor_infos=[]), strategy=strategy, sync_path="", owns_ray=False,
                      engine=engine, **fields)


def test_the_servers_version_and_stats_are_the_embedded_engines_and_unknown_on_vllm() -> None:
    embedded, vllm = _stack(engine=_Engine()), _stack()
    assert embedded.server_version("t") == 4 and vllm.server_version("t") is None
    assert embedded.engine_stats() == {"decode_steps": 3, "generated_tokens": 40} and vllm.engine_stats() == {}


def test_a_steps_metrics_are_the_workers_with_the_lr_its_optimizer_reports() -> None:
    stack = _stack("fsdp2")
    reported = {"policy_loss": 0.25, "policy_lr": 3e-6}
    assert stack.step_metrics("t", reported, 1.5) == {"policy_loss": 0.25, "policy_lr": 3e-6, "grad_norm": 1.5,
                                                      "lr": 3e-6}
    assert stack.step_metrics("t", {"policy_loss": 0.25}, None) == {"policy_loss": 0.25, "grad_norm": 0.0, "lr": None}
    embedded = _stack("embedded")
    embedded.worker_call = lambda method, *args: {"called": (method, *args)}  # the embedded Trainer's own metrics
    assert embedded.step_metrics("t", reported, 1.5) == {"called": ("step_metrics", "t")}


def test_a_resumed_tenants_adapter_is_loaded_as_its_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Into the embedded engine as the version given; on vLLM by name (vLLM counts its own versions); either way the
    tenant's view resumes at that version."""
    monkeypatch.setattr(stack_module, "load_peft_adapter", lambda folder: f"weights of {folder.name}")
    engine = _Engine()
    embedded = _stack(engine=engine)
    asyncio.run(embedded.publish_as("t", tmp_path / "step-3", 3))
    assert engine.published == [("t", "weights of step-3", 3)] and embedded.views["t"].resumed == [3]
    vllm = _stack()
    asyncio.run(vllm.publish_as("t", tmp_path / "step-5", 5))
    assert vllm.client.loaded == [("t", str(tmp_path / "step-5"))] and vllm.views["t"].resumed == [5]


def test_a_failed_tenants_adapter_is_unloaded_once_its_requests_are_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answers "in flight" while the tenant's last requests finish: the unload is asked again until it
    lands; any other answer ends the attempt without raising."""
    waits: list[float] = []

    async def no_wait(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(stack_module.asyncio, "sleep", no_wait)
    busy = RuntimeError("409: requests of 't' in flight")
    stack = _stack(client=_Client([busy, busy, None]))
    asyncio.run(stack.unload("t"))
    assert stack.client.unloads == 3 and waits == [0.05, 0.05]
    gone = _stack(client=_Client([RuntimeError("404: no adapter 't'"), None]))
    asyncio.run(gone.unload("t"))
    assert gone.client.unloads == 1


def test_shutdown_stops_what_the_stack_started_once(monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[str] = []
    ray_shutdowns: list[int] = []
    monkeypatch.setattr(stack_module.ray, "kill", killed.append)
    monkeypatch.setattr(stack_module.ray, "shutdown", lambda: ray_shutdowns.append(1))
    engine, server, group, router = _Engine(), _Stoppable(), _Stoppable(), _Stoppable()
    setup = SimpleNamespace(server_groups=[group], prefill_server_groups=[], decode_server_groups=[], router=router)
    stack = _stack(engine=engine, server=server, server_setup=setup)
    stack.policy_group = SimpleNamespace(actor_infos=[SimpleNamespace(handle="worker-0"),
                                                      SimpleNamespace(handle="worker-1")])
    stack.owns_ray = True
    stack.shutdown()
    stack.shutdown()
    assert killed == ["worker-0", "worker-1"] and ray_shutdowns == [1]
    assert (engine.shutdowns, server.stops, group.stops, router.stops) == (1, 1, 1, 1)
    borrowed = _stack()
    borrowed.shutdown()
    assert ray_shutdowns == [1], "a Ray the caller started is left running"


@pytest.mark.parametrize(("strategy", "inference_backend", "started"), [
    ("embedded", "embedded", "small ray"), ("fsdp2", "embedded", "small ray"),
    ("fsdp2", "vllm", "skyrl's ray"), ("megatron", "vllm", "skyrl's ray"),
])
def test_ray_starts_small_beside_the_embedded_engine_with_the_registries_synced_beside_the_workers(
        monkeypatch: pytest.MonkeyPatch, strategy: str, inference_backend: str, started: str) -> None:
    import skyrl.train.utils.utils as skyrl_utils

    calls: list[tuple[str, Any]] = []
    synced = concurrent.futures.Future()
    monkeypatch.setattr(stack_module, "start_ray", lambda **kwargs: calls.append(("small ray", kwargs)))
    monkeypatch.setattr(stack_module, "sync_skyrl_registries", lambda: synced.result(timeout=30))
    monkeypatch.setattr(stack_module, "forget_stale_registry_actors", lambda: None)
    monkeypatch.setattr(skyrl_utils, "initialize_ray", lambda cfg: calls.append(("skyrl's ray", cfg)))
    monkeypatch.setattr(skyrl_utils, "prepare_runtime_environment", lambda cfg: {"SKYRL_ENV": "1"})
    plan = _plan(strategy, inference_backend)
    join = stack_module.start_stack_ray(plan)
    assert [name for name, _ in calls] == [started]
    if started == "skyrl's ray":
        assert join is None and calls[0][1] is plan.base  # SkyRL's initialize_ray synced the registries itself
        return
    options = calls[0][1]
    assert options["include_dashboard"] is False and options["num_cpus"] == 2
    expected_env = {"SKYRL_ENV": "1"} if strategy == "fsdp2" else {"OMP_NUM_THREADS": stack_module.os.environ.get(
        "OMP_NUM_THREADS", "1")}
    assert options["runtime_env"] == {"env_vars": expected_env}
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(join)
    assert not waiting.done()  # the sync runs in the background: the join waits for it
    synced.set_result(None)
    waiting.result(timeout=30)


def test_a_background_works_failure_is_raised_by_its_join() -> None:
    def fails() -> None:
        raise RuntimeError("registry actor died")

    with pytest.raises(RuntimeError, match="^registry actor died$"):
        stack_module.in_background(fails)()
    done: list[int] = []
    stack_module.in_background(lambda: done.append(1))()
    assert done == [1]
