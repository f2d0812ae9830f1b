"""Versioned in-place publication of a tenant's adapter into the sampler.

After a tenant's train step, :meth:`AdapterSync.publish` hands its new weights to the engine, which copies
them into the tenant's adapter slot between two decode steps once none of that tenant's requests is
running (the version fence); other tenants keep decoding and keep their state. Versions per tenant start
at 0 (the initial adapter) and increase by one per publish.
"""

from __future__ import annotations

import asyncio
import time

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.sampler.engine_thread import EngineThread


class AdapterSync:
    """Publishes tenants' adapters into the engine in place; the engine's ``AdapterSlots`` own the versions."""

    def __init__(self, engine: EngineThread) -> None:
        self.engine = engine

    def register(self, tenant: str, weights: AdapterWeights) -> None:
        """Publishes the tenant's initial adapter as version 0."""
        self.engine.register_adapter(tenant, weights, version=0)

    def version(self, tenant: str) -> int:
        """The tenant's published version."""
        return self.engine.adapter_version(tenant)

    async def unregister(self, tenant: str) -> None:
        """Frees the tenant's sampler slot once its running requests are done."""
        await asyncio.wrap_future(self.engine.unregister_adapter(tenant))

    async def publish_as(self, tenant: str, weights: AdapterWeights, version: int) -> None:
        """Publishes ``weights`` as the tenant's ``version`` (a resumed tenant's checkpointed adapter)."""
        await asyncio.wrap_future(self.engine.publish(tenant, weights, version))

    async def publish(self, tenant: str, weights: AdapterWeights) -> tuple[int, float]:
        """Publishes ``weights`` as the tenant's next version; returns (version, seconds until applied)."""
        version = self.engine.adapter_version(tenant) + 1
        started = time.perf_counter()
        await asyncio.wrap_future(self.engine.publish(tenant, weights, version))
        return version, time.perf_counter() - started
