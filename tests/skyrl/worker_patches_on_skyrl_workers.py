"""``with_per_tenant_lora_sync`` on SkyRL's real Megatron and FSDP policy worker classes.

Not collected by the main test run: ``test_worker_patches.py`` runs it with pytest in a subprocess whose
``conftest.py`` stubs the GPU-only imports of those worker modules (``gpu_only_stubs``). Each worker is a
minimal subclass of the real class that stubs only the weight I/O: the adapter export, and for a full-weight
sync the weight sender (``_weight_sync_engine``, and the ``weight_senders`` module, which imports vLLM);
``broadcast_to_inference_engines``, the LoRA branch and the reset logic are SkyRL's, under the mixin.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from unittest.mock import AsyncMock, patch

import pytest
from skyrl.train.config import SkyRLTrainConfig

from skyrl_clora.skyrl.worker_patches import with_per_tenant_lora_sync

# (model_id, prefix_cache_salted, fully_async (with clear_kv_cache_on_weight_sync), in-place LoRA branch) -> reset?
CASES = [
    ("tenant-a", True, False, True, False),  # a salted adapter's in-place sync: no global reset
    ("tenant-a", False, False, True, True),  # not salted (stock dispatch, Tinker sample()): reset as upstream
    (None, True, False, True, True),  # single-tenant sync
    ("tenant-a", True, True, True, True),  # fully async with clear_kv_cache_on_weight_sync: reset as configured
    ("tenant-a", True, False, False, True),  # full-weight sync (merged LoRA / no LoRA): every model changed
]


def _cfg(fully_async: bool, lora_in_place: bool) -> SkyRLTrainConfig:
    cfg = SkyRLTrainConfig()
    cfg.trainer.placement.colocate_all = False
    cfg.trainer.fully_async.enabled = fully_async
    cfg.trainer.fully_async.clear_kv_cache_on_weight_sync = fully_async
    cfg.trainer.policy.model.lora.rank = 8
    cfg.trainer.policy.megatron_config.lora_config.merge_lora = not lora_in_place
    cfg.generator.inference_engine.enable_prefix_caching = True
    return cfg


def _sync(worker_cls: type, cfg: SkyRLTrainConfig, model_id, salted: bool, is_lora: bool,
          monkeypatch: pytest.MonkeyPatch) -> AsyncMock:
    worker = with_per_tenant_lora_sync(worker_cls)(
        cfg=cfg.trainer, world_size=1, rank=0, local_rank=0, master_addr="localhost", master_port=12345,
        sequence_parallel_size=1,
    )
    worker._is_lora = is_lora
    worker.model = SimpleNamespace(model=SimpleNamespace(peft_config={}))
    sent = []
    worker._weight_sync_engine = SimpleNamespace(
        skyrl_handles_prefix_cache_reset=False, skyrl_force_disable_expandable_segments=False,
        skyrl_empty_cache_after_send=False, send_weights=lambda: sent.append("weights"),
    )
    engines = AsyncMock()
    senders = SimpleNamespace(maybe_set_reset_prefix_cache=lambda engine, reset: None)
    monkeypatch.setitem(sys.modules, "skyrl.backends.skyrl_train.weight_sync.weight_senders", senders)
    with patch("torch.distributed.get_rank", return_value=0), patch("torch.distributed.barrier"):
        asyncio.run(worker.broadcast_to_inference_engines(engines, cfg.generator.inference_engine, model_id=model_id,
                                                          prefix_cache_salted=salted))
    assert engines.load_lora_adapter.await_count + len(sent) == 1  # one adapter load or one full-weight send
    return engines


@pytest.mark.parametrize("model_id,salted,fully_async,lora_in_place,expect_reset", CASES)
def test_megatron_policy_worker(model_id, salted, fully_async, lora_in_place, expect_reset, monkeypatch) -> None:
    from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import MegatronPolicyWorkerBase

    class Worker(MegatronPolicyWorkerBase):
        async def _save_lora_adapters_and_sync(self, lora_sync_path, client, lora_name):
            await client.load_lora_adapter(lora_name, lora_sync_path)

        async def _publish_lora_adapter_in_memory(self, lora_name, client):
            await client.load_lora_adapter(lora_name, None)

    engines = _sync(Worker, _cfg(fully_async, lora_in_place), model_id, salted, True, monkeypatch)
    assert engines.reset_prefix_cache.await_count == int(expect_reset)


@pytest.mark.parametrize("model_id,salted,fully_async,lora_in_place,expect_reset", CASES)
def test_fsdp_policy_worker(model_id, salted, fully_async, lora_in_place, expect_reset, monkeypatch) -> None:
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    class Worker(FSDPPolicyWorkerBase):
        async def _save_lora_adapters_and_sync(self, peft_model, lora_sync_path, client, lora_name):
            await client.load_lora_adapter(lora_name, lora_sync_path)

    engines = _sync(Worker, _cfg(fully_async, lora_in_place), model_id, salted, lora_in_place, monkeypatch)
    assert engines.reset_prefix_cache.await_count == int(expect_reset)


def test_without_the_flag_the_worker_resets_as_upstream() -> None:
    """SkyRL 0.4's own dispatch never sends ``prefix_cache_salted``: the stack's Megatron worker resets as before."""
    from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import MegatronPolicyWorkerBase

    class Worker(MegatronPolicyWorkerBase):
        async def _save_lora_adapters_and_sync(self, lora_sync_path, client, lora_name):
            await client.load_lora_adapter(lora_name, lora_sync_path)

    cfg = _cfg(False, True)
    worker = with_per_tenant_lora_sync(Worker)(cfg=cfg.trainer, world_size=1, rank=0, local_rank=0,
                                               master_addr="localhost", master_port=12345, sequence_parallel_size=1)
    worker._is_lora = True
    engines = AsyncMock()
    with patch("torch.distributed.get_rank", return_value=0), patch("torch.distributed.barrier"):
        asyncio.run(worker.broadcast_to_inference_engines(engines, cfg.generator.inference_engine, "tenant-a"))
    engines.reset_prefix_cache.assert_awaited_once_with(reset_running_requests=True)


def test_seeded_adapters_compose_with_the_sync_form_on_the_megatron_worker() -> None:
    """``with_seeded_tenant_adapters`` over patch 0001's form over SkyRL's real Megatron worker: its
    ``register_adapter`` runs SkyRL's (``AdapterStore.create`` with the store's signature) first, and an id
    without a seed (the KL reference) keeps the pristine adapter (no swap, no re-draw)."""
    from unittest.mock import MagicMock

    from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import MegatronPolicyWorkerBase

    from skyrl_clora.skyrl.megatron_seeding import with_seeded_tenant_adapters

    cfg = _cfg(False, True)
    cls = with_seeded_tenant_adapters(with_per_tenant_lora_sync(MegatronPolicyWorkerBase))
    worker = cls(cfg=cfg.trainer, world_size=1, rank=0, local_rank=0, master_addr="localhost", master_port=12345,
                 sequence_parallel_size=1)
    worker.adapter_store = MagicMock(signature="signature")
    worker.set_adapter_seeds({"tenant-a": 3})
    worker.register_adapter("clora:reference")
    worker.adapter_store.create.assert_called_once()
    assert worker.adapter_store.create.call_args.args[0] == "clora:reference"
    worker.adapter_store.swap_to.assert_not_called()
