"""Run-time form of integration/patches/0002: no global prefix-cache reset on a tenant's LoRA sync.

skyrl 0.4's policy workers (``MegatronPolicyWorkerBase`` / ``FSDPPolicyWorkerBase``) start
``_reset_prefix_cache_task`` -- ``reset_prefix_cache(reset_running_requests=True)`` on every inference
engine -- inside ``broadcast_to_inference_engines`` on every LoRA sync, including a multi-tenant sync of
one adapter (``model_id`` set). That drops every tenant's cached prefixes and makes vLLM recompute every
running request of every tenant. With per-tenant cache salts (patch 0001, or
:class:`~skyrl_clora.skyrl.tenant_client.TenantInferenceClient`) the reset is unnecessary: the synced
adapter's requests get a new salt, the others keep theirs.

:func:`with_per_tenant_lora_sync` derives a worker class that skips the reset exactly when
``broadcast_to_inference_engines`` is called with a ``model_id``; a single-tenant sync (``model_id=None``)
behaves as upstream. Use the derived class wherever SkyRL's policy worker class is named (before it is
wrapped as a Ray actor) until upstream takes the patch.
"""

from __future__ import annotations

from typing import Any, Optional


class PerTenantLoraSyncMixin:
    """Skips the engines' prefix-cache reset during a per-tenant (``model_id``) adapter sync."""

    _clora_tenant_sync: bool = False

    async def broadcast_to_inference_engines(
        self, inference_engine_client: Any, inference_engine_cfg: Any, model_id: Optional[str] = None
    ) -> Any:
        self._clora_tenant_sync = model_id is not None
        try:
            return await super().broadcast_to_inference_engines(  # type: ignore[misc]
                inference_engine_client, inference_engine_cfg, model_id=model_id
            )
        finally:
            self._clora_tenant_sync = False

    def _reset_prefix_cache_task(self, inference_engine_client: Any, inference_engine_cfg: Any) -> Any:
        """None (no reset) during a tenant's adapter sync; SkyRL's behaviour otherwise."""
        if self._clora_tenant_sync:
            return None
        return super()._reset_prefix_cache_task(inference_engine_client, inference_engine_cfg)  # type: ignore[misc]


def with_per_tenant_lora_sync(worker_cls: type) -> type:
    """``worker_cls`` (a SkyRL policy worker class) with :class:`PerTenantLoraSyncMixin` in front."""
    for name in ("broadcast_to_inference_engines", "_reset_prefix_cache_task"):
        if not callable(getattr(worker_cls, name, None)):
            raise TypeError(f"{worker_cls.__name__} has no {name}; the installed SkyRL does not match patch 0002")
    return type(f"PerTenantSync{worker_cls.__name__}", (PerTenantLoraSyncMixin, worker_cls), {})
