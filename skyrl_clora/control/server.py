"""The live run's control endpoint: tenants added and stopped while the others run.

While a run goes, an HTTP server on loopback (an ephemeral port) answers ``GET /tenants`` (the running tenants),
``POST /tenants`` with a tenant's overrides as JSON (the keys of ``+tenants=[...]``; ``name`` required) and
``POST /tenants/<name>/stop``. Every request must carry ``Authorization: Bearer <token>``, the token drawn when the
endpoint starts; ``<output_dir>/control.json`` holds ``{"url", "token"}``, mode 0600 (its owner alone can use the
endpoint). A request without the token gets status 401 and changes nothing; a bad request gets status 400; both
with a one-line ``error``, and the run goes on. ``python -m skyrl_clora.ctl`` is its command line.

Added and stopped tenants are recorded in ``<output_dir>/live_tenants.json``, so that a resumed run has them too:
an added tenant resumes like the others, a stopped one stays stopped.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any, Protocol

from aiohttp import web

from skyrl_clora.checkpoints import read_live_tenants, write_live_tenants
from skyrl_clora.config.schema import ConfigError, RunConfig
from skyrl_clora.config.build import check_tenant_overrides, tenant_defaults
from skyrl_clora.control.auth import bearer_auth, new_token, write_private
from skyrl_clora.recipes.plugin import TaskSource, build_task_sources
from skyrl_clora.tenants import TenantSpec, expand_tenants

CONTROL_FILE = "control.json"


class ControlledTenants(Protocol):
    """What the endpoint asks of the run's tenants: a :class:`TenantPool`, or the tenants of several replicas."""

    async def add(self, spec: TenantSpec, source: TaskSource) -> Any:
        """Starts tenant ``spec`` (validated) beside the running ones; a :class:`ConfigError` says why not."""

    def stop(self, name: str) -> None:
        """Asks running tenant ``name`` to stop after its current step; a :class:`ConfigError` says why not."""

    async def steps_done(self) -> dict[str, int]:
        """The RL steps done by each running tenant."""


class ControlServer:
    """Serves the control endpoint for ``pool`` on the running event loop (see the module docstring)."""

    def __init__(self, run: RunConfig, pool: ControlledTenants, known: list[str]) -> None:
        self.run, self.pool = run, pool
        self.known = list(known)  # every tenant name of the run, finished or not: names stay unique
        self.added, self.stopped = read_live_tenants(run.output_dir)
        self._runner: web.AppRunner | None = None

    def app(self, token: str) -> web.Application:
        """The aiohttp application of the endpoint, admitting requests that carry ``token``."""
        hint = (f"the token in {self.run.output_dir / CONTROL_FILE}; "
                f"python -m skyrl_clora.ctl --dir {self.run.output_dir} sends it")
        app = web.Application(middlewares=[bearer_auth(token, lambda message: {"error": message}, hint)])
        app.add_routes([web.get("/tenants", self._list), web.post("/tenants", self._add),
                        web.post("/tenants/{name}/stop", self._stop)])
        return app

    async def start(self) -> str:
        """Serves the endpoint with a new token, both written to ``control.json`` (mode 0600); returns its URL."""
        token = new_token()
        self._runner = web.AppRunner(self.app(token), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}"
        write_private(self.run.output_dir / CONTROL_FILE, json.dumps({"url": url, "token": token}) + "\n")
        return url

    async def close(self) -> None:
        (self.run.output_dir / CONTROL_FILE).unlink(missing_ok=True)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _list(self, request: web.Request) -> web.Response:
        steps_done = await self.pool.steps_done()
        return web.json_response({"running": [{"name": name, "steps_done": done, "steps": self.run.steps}
                                              for name, done in steps_done.items()]})

    async def _add(self, request: web.Request) -> web.Response:
        try:
            overrides = await request.json()
            spec = self._spec(overrides)
            source = await asyncio.to_thread(self._task_source, spec)
            await self.pool.add(spec, source)
        except (ConfigError, ValueError) as error:
            return web.json_response({"error": str(error)}, status=400)
        self.known.append(spec.name)
        self.added.append(spec)
        write_live_tenants(self.run.output_dir, self.added, self.stopped)
        return web.json_response({"added": asdict(spec)})

    def _task_source(self, spec: TenantSpec) -> TaskSource:
        """The added tenant's task data, its prompts over ``trainer.max_prompt_length`` dropped as at the start."""
        from skyrl_clora.base_model import prompt_tokenizer

        return build_task_sources(self.run.recipe, [spec], self.run.max_training_steps, self.run.seed,
                                  prompt_tokenizer(self.run))[spec.name]

    async def _stop(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            self.pool.stop(name)
        except ConfigError as error:
            return web.json_response({"error": str(error)}, status=400)
        self.stopped.append(name)
        write_live_tenants(self.run.output_dir, self.added, self.stopped)
        return web.json_response({"stopping": name})

    def _spec(self, overrides: Any) -> TenantSpec:
        """The added tenant's spec, validated as a start-time tenant's: the run's defaults, its own overrides."""
        if not isinstance(overrides, dict) or "name" not in overrides:
            raise ConfigError("an added tenant needs its overrides as a mapping with a name, e.g. {name: t9, lr: 1e-3}")
        run = self.run
        defaults = tenant_defaults(run.seed + len(self.known), run.lora, run.trainer, run.recipe)
        spec = expand_tenants([overrides], **defaults)[0]
        check_tenant_overrides(spec, run.trainer, run.backend)
        if spec.name in self.known:
            raise ConfigError(f"tenant name {spec.name} is taken in this run; choose another")
        if spec.rank > run.lora.max_lora_rank:
            raise ConfigError(f"tenant {spec.name} has lora rank {spec.rank} > "
                              f"sampler.max_lora_rank={run.lora.max_lora_rank}; lower its rank")
        return spec
