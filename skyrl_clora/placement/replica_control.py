"""Live control of a replicated run: the control endpoint (:mod:`skyrl_clora.control.server`) over every replica's tenants.

The endpoint runs on an event loop in a thread of the driver; its requests go to the
:class:`~skyrl_clora.placement.replica_set.ReplicaSet` through :meth:`ReplicaSet.call` (run on the driver's
thread between its waits): an added tenant starts on the live replica with room that runs the fewest tenants, a
stop goes to the replica holding the tenant. What the endpoint records (``live_tenants.json``) is what a
one-replica run records, so a resumed run (replicated or not) keeps the added tenants and the stopped ones stopped.
"""

from __future__ import annotations

import asyncio
import threading

from skyrl_clora.config.schema import RunConfig
from skyrl_clora.control.server import ControlServer
from skyrl_clora.placement.replica_set import ReplicaSet
from skyrl_clora.recipes.plugin import TaskSource
from skyrl_clora.tenants import TenantSpec


class ReplicaTenants:
    """:class:`~skyrl_clora.control.server.ControlledTenants` over the tenants of ``replicas`` (each replica builds an
    added tenant's task data itself)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    async def add(self, spec: TenantSpec, source: TaskSource) -> None:
        await asyncio.to_thread(self.replicas.call, lambda: self.replicas.add_tenant(spec))

    def stop(self, name: str) -> None:
        self.replicas.call(lambda: self.replicas.stop_tenant(name))

    async def steps_done(self) -> dict[str, int]:
        return await asyncio.to_thread(self.replicas.call, self.replicas.steps_done)


class ReplicaControl:
    """The control endpoint of a replicated run, served from :meth:`start` until :meth:`close` (a thread with its
    own event loop; ``<output_dir>/control.json`` names it while it serves)."""

    def __init__(self, run: RunConfig, replicas: ReplicaSet, known: list[str]) -> None:
        self.server = ControlServer(run, ReplicaTenants(replicas), known)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="replica-control", daemon=True)

    def start(self) -> None:
        """Serves the endpoint; raises what its start raised."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._closing = asyncio.get_running_loop(), asyncio.Event()
        try:
            await self.server.start()
        except BaseException as error:  # noqa: BLE001 - raised again by start
            self._error = error
            self._started.set()
            return
        self._started.set()
        try:
            await self._closing.wait()
        finally:
            await self.server.close()

    def close(self) -> None:
        """Stops serving (control.json removed)."""
        if self._loop is not None and self._error is None:
            self._loop.call_soon_threadsafe(self._closing.set)
        self._thread.join()
