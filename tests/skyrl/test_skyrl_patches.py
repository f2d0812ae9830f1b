"""The upstream patches in integration/patches and their run-time forms in skyrl_clora.skyrl."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import skyrl
import torch
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
from skyrl.env_vars import SKYRL_GENERATE_CONCURRENCY_PER_ENGINE
from skyrl.train.generators.utils import build_vllm_cache_salt

from skyrl_clora.skyrl.tenant_client import tenant_views
from skyrl_clora.skyrl.worker_patches import with_per_tenant_lora_sync

PATCHES = sorted((Path(__file__).resolve().parents[2] / "integration" / "patches").glob("*.patch"))


def test_patches_apply_to_the_installed_skyrl() -> None:
    assert [p.name[:4] for p in PATCHES] == ["0001", "0002", "0003"]
    if shutil.which("patch") is None:
        pytest.skip("the patch tool is not installed")
    site_packages = Path(skyrl.__file__).resolve().parent.parent
    for patch in PATCHES:
        result = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(site_packages), "-i", str(patch)],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{patch.name} does not apply: {result.stdout}{result.stderr}"


class _Engines:
    """Records the control-plane calls a worker's LoRA sync makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        self.calls.append(f"reset(running={reset_running_requests})")

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.calls.append(f"load({name})")


class _LoraWorker(PolicyWorkerBase):
    """SkyRL's PolicyWorkerBase with the LoRA branch of skyrl 0.4's Megatron/FSDP
    ``broadcast_to_inference_engines`` (reset task started, adapter loaded under its name, reset awaited)."""

    async def broadcast_to_inference_engines(self, inference_engine_client, inference_engine_cfg, model_id=None):
        cache_reset_task = self._reset_prefix_cache_task(inference_engine_client, inference_engine_cfg)
        await inference_engine_client.load_lora_adapter(model_id or "skyrl-lora", "/tmp/sync")
        if cache_reset_task is not None:
            await cache_reset_task


def _sync(worker_cls: type, model_id: str | None, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    worker = object.__new__(worker_cls)
    worker.cfg = SimpleNamespace(fully_async=SimpleNamespace(enabled=False, clear_kv_cache_on_weight_sync=False))
    engines = _Engines()
    asyncio.run(worker.broadcast_to_inference_engines(engines, SimpleNamespace(enable_prefix_caching=True), model_id))
    return engines.calls


def test_tenant_lora_sync_skips_the_global_prefix_cache_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _sync(_LoraWorker, "t0", monkeypatch) == ["load(t0)", "reset(running=True)"], "upstream resets for a tenant"
    patched = with_per_tenant_lora_sync(_LoraWorker)
    assert _sync(patched, "t0", monkeypatch) == ["load(t0)"]
    assert _sync(patched, None, monkeypatch) == ["load(skyrl-lora)", "reset(running=True)"]
    with pytest.raises(TypeError, match="does not match patch 0002"):
        with_per_tenant_lora_sync(object)


def test_a_global_version_bump_leaves_tenant_salts_alone() -> None:
    shared = RemoteInferenceClient(proxy_url="http://127.0.0.1:1", server_urls=["http://127.0.0.1:1"],
                                   data_parallel_size=1, model_name="base")
    views = tenant_views(shared, ["a", "b"], max_in_flight=3)
    shared.increment_weight_version()  # what WorkerDispatch.save_weights_for_sampler does after any adapter's sync
    assert views["a"].weight_version == views["b"].weight_version == -1  # no adapter loaded yet
    for view in views.values():
        view.increment_weight_version()  # each tenant's first sync (its version 0)
    views["a"].increment_weight_version()  # the next sync of tenant a
    assert shared.weight_version == 1
    assert build_vllm_cache_salt(views["a"].weight_version, "a") == "a:1"
    assert build_vllm_cache_salt(views["b"].weight_version, "b") == "b:0"
    assert views["a"].max_in_flight == views["b"].max_in_flight == 3
    assert tenant_views(shared, ["a", "b"])["a"].max_in_flight == max(1, SKYRL_GENERATE_CONCURRENCY_PER_ENGINE // 2)


def test_a_tenant_view_refuses_a_generate_batch_without_sampling_params() -> None:
    """Run-time form of 0003: the stock client would send {} and vLLM would stop after 16 tokens."""
    shared = RemoteInferenceClient(proxy_url="http://127.0.0.1:9", server_urls=["http://127.0.0.1:9"], data_parallel_size=1,
                                   model_name="base")
    view = tenant_views(shared, ["tenant-a"])["tenant-a"]
    with pytest.raises(ValueError, match="needs input_batch\\['sampling_params'\\]"):
        asyncio.run(view.generate({"prompt_token_ids": [[1, 2, 3]]}))
