"""Run-time form of integration/patches/0001 (worker and dispatch halves): a multi-LoRA adapter sync skips the
global prefix-cache reset only when that adapter's requests are salted by its own version.

skyrl 0.4's policy workers (``MegatronPolicyWorkerBase`` / ``FSDPPolicyWorkerBase``) start
``_reset_prefix_cache_task`` -- ``reset_prefix_cache(reset_running_requests=True)`` on every inference
engine -- inside ``broadcast_to_inference_engines`` on every LoRA sync, including an in-place sync of one
adapter (``model_id`` set). That drops every tenant's cached prefixes and makes the engines recompute every
running request of every tenant. The reset is only redundant when the synced adapter's requests carry a cache
salt that changes with its version (SkyRL's generator over a
:class:`~skyrl_clora.backends.skyrl.tenant_client.TenantInferenceClient` view): then its later requests cannot hit
blocks computed with its old weights (vLLM keys a LoRA's blocks by adapter name, not by the loaded weights,
vllm-project/vllm#42125). SkyRL's Tinker ``sample()`` path sends no salt, so there the reset stays.

- :func:`with_per_tenant_lora_sync` derives a worker class whose ``broadcast_to_inference_engines`` takes the
  patch's ``prefix_cache_salted`` flag and skips the reset of the in-place LoRA branch only when ``model_id``
  is set, the flag is True and training is synchronous (fully-async runs keep their
  ``clear_kv_cache_on_weight_sync`` setting). Full-weight syncs (``_sync_weights_to_inference_engines``,
  e.g. merged LoRA) always keep the reset. Without the flag it behaves as upstream.
- :func:`with_salt_gated_lora_sync` derives a ``WorkerDispatch`` class that sends the flag, as the patched
  dispatch does: only for a ``model_id`` whose inference client reports ``prefix_cache_salted(model_id)``
  (a ``TenantInferenceClient`` view does, once its tenant's requests were all salted).

Use the derived classes wherever SkyRL's classes are named (the worker before it is wrapped as a Ray actor)
until upstream takes the patch. A worker that is sent the flag must accept it (the patched SkyRL's workers do).
"""

from __future__ import annotations

from typing import Any, Optional

import ray


class PerTenantLoraSyncMixin:
    """Skips the engines' prefix-cache reset of an in-place adapter sync whose requests are salted."""

    _clora_skip_reset: bool = False

    async def broadcast_to_inference_engines(
        self, inference_engine_client: Any, inference_engine_cfg: Any, model_id: Optional[str] = None,
        prefix_cache_salted: bool = False,
    ) -> Any:
        self._clora_skip_reset = (
            model_id is not None and prefix_cache_salted and not self.cfg.fully_async.enabled  # type: ignore[attr-defined]
        )
        try:
            return await super().broadcast_to_inference_engines(  # type: ignore[misc]
                inference_engine_client, inference_engine_cfg, model_id=model_id
            )
        finally:
            self._clora_skip_reset = False

    async def _sync_weights_to_inference_engines(self, *args: Any, **kwargs: Any) -> Any:
        """A full-weight sync (not the in-place LoRA branch) changes every model's weights: it keeps the reset."""
        skip, self._clora_skip_reset = self._clora_skip_reset, False
        try:
            return await super()._sync_weights_to_inference_engines(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._clora_skip_reset = skip

    def _reset_prefix_cache_task(self, inference_engine_client: Any, inference_engine_cfg: Any) -> Any:
        """None (no reset) during a salted adapter's in-place sync; SkyRL's behaviour otherwise."""
        if self._clora_skip_reset:
            return None
        return super()._reset_prefix_cache_task(inference_engine_client, inference_engine_cfg)  # type: ignore[misc]


def with_per_tenant_lora_sync(worker_cls: type) -> type:
    """``worker_cls`` (a SkyRL policy worker class) with :class:`PerTenantLoraSyncMixin` in front."""
    for name in ("broadcast_to_inference_engines", "_reset_prefix_cache_task", "_sync_weights_to_inference_engines"):
        if not callable(getattr(worker_cls, name, None)):
            raise TypeError(f"{worker_cls.__name__} has no {name}; the installed SkyRL does not match patch 0001")
    return type(f"PerTenantSync{worker_cls.__name__}", (PerTenantLoraSyncMixin, worker_cls), {})


class SaltGatedLoraSyncMixin:
    """``WorkerDispatch`` that tells the workers when a synced adapter's requests are all salted."""

    def _broadcast_to_inference_engines(self, inference_engine_client: Any, model_id: Optional[str] = None) -> None:
        salted = getattr(inference_engine_client, "prefix_cache_salted", None)
        if model_id is None or salted is None or salted(model_id) is not True:
            return super()._broadcast_to_inference_engines(  # type: ignore[misc]
                inference_engine_client, model_id=model_id
            )
        # As the stock method (the workers cached the client at init_weight_sync_state), plus the flag.
        ray.get(
            self._actor_groups["policy"].async_run_ray_method(  # type: ignore[attr-defined]
                "pass_through", "broadcast_to_inference_engines", None,
                self.cfg.generator.inference_engine, model_id=model_id, prefix_cache_salted=True,  # type: ignore[attr-defined]
            )
        )


def with_salt_gated_lora_sync(dispatch_cls: type) -> type:
    """``dispatch_cls`` (SkyRL's ``WorkerDispatch``) with :class:`SaltGatedLoraSyncMixin` in front."""
    if not callable(getattr(dispatch_cls, "_broadcast_to_inference_engines", None)):
        raise TypeError(f"{dispatch_cls.__name__} has no _broadcast_to_inference_engines; the installed SkyRL does "
                        "not match patch 0001")
    return type(f"SaltGated{dispatch_cls.__name__}", (SaltGatedLoraSyncMixin, dispatch_cls), {})
