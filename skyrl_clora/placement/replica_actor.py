"""One live replica: the body of a Ray actor that runs a one-replica run while the driver talks to it.

The actor runs :func:`skyrl_clora.backends.embedded.backend.run_experiments` in a thread of its own, with itself as the
run's :class:`~skyrl_clora.tenant_loop.PoolHost`: the tenant pool stays open until the driver closes the replica,
so tenants move in (:meth:`ReplicaRunner.add`, resuming from a checkpoint) and out (:meth:`ReplicaRunner.stop`
at a step boundary, checkpointed) while the others run. The driver's calls run on Ray's threads (the actor is
created with ``max_concurrency`` = :data:`ACTOR_CONCURRENCY`) and hand their work to the pool's event loop.

Contract with the driver: every tenant loop that ends here (finished, stopped or failed) is released (its slot and
services state freed; a tenant that stopped to move has its records dropped from this replica's metrics log, the
destination's log carries them) and only then reported by :meth:`ReplicaRunner.wait_ended`, in the order they
ended; a tenant that never started (the driver forwarded a signal before the replica's pool started) is reported
``stopped`` at its checkpoint's step. :meth:`ReplicaRunner.close` ends the run once no tenant runs and returns the
replica's summary.
:meth:`ReplicaRunner.interrupt` is how a signal to the driver reaches the replica: its tenants stop after their
current step as a one-replica run's do (``interrupts``); the actor's process takes no signal itself (Ray starts
it in a process group of its own with SIGINT blocked, so a Ctrl-C at the driver's terminal does not reach it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

from skyrl_clora.checkpoints import TenantCheckpoint
from skyrl_clora.config.schema import RunConfig
from skyrl_clora.tenant_loop import TenantPool
from skyrl_clora.tenants import TenantSpec

logger = logging.getLogger("skyrl_clora")

ACTOR_CONCURRENCY = 8  # the driver's calls in flight on one replica: its wait_ended and a few short ones


@dataclass(frozen=True)
class TenantEnd:
    """A tenant loop that ended on a replica: how (``finished``, ``stopped`` or ``failed``) and after how many RL
    steps."""

    tenant: str
    outcome: str
    step: int


class _Host:
    """The :class:`~skyrl_clora.tenant_loop.PoolHost` of a replica's run (its coroutines run on the pool's event
    loop; kept off the actor class, which Ray would otherwise make an asyncio actor)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()  # guards ended and done
        self.ended: list[TenantEnd] = []
        self.done = False
        self.served = threading.Event()  # the pool is open (or the run ended without one)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pool: TenantPool | None = None
        self.closing: asyncio.Event | None = None
        self.moving: set[str] = set()  # tenants asked to stop here to move elsewhere
        self._reports: set[asyncio.Task] = set()

    async def serve(self, pool: TenantPool) -> None:
        """Watches the pool's tenants until the replica is closed."""
        self.loop, self.pool, self.closing = asyncio.get_running_loop(), pool, asyncio.Event()
        for name, task in list(pool.tasks.items()):
            self.watch(name, task)
        self.served.set()
        await self.closing.wait()
        await pool.join()

    def watch(self, name: str, task: asyncio.Task) -> None:
        """Reports tenant ``name`` (released first) once its loop's ``task`` is done."""
        def ended(_: asyncio.Task) -> None:
            report = self.loop.create_task(self._ended_here(name))
            self._reports.add(report)  # held until done: the event loop keeps only weak references to tasks
            report.add_done_callback(self._reports.discard)

        task.add_done_callback(ended)

    async def _ended_here(self, name: str) -> None:
        """Releases tenant ``name`` whose loop ended, then reports it."""
        loop = self.pool.loops[name]
        end = TenantEnd(name, loop.outcome or "failed", loop.step)
        try:
            await self.pool.release(name)
            if name in self.moving and end.outcome == "stopped":
                self.pool.metrics.forget(name)
        except Exception:  # noqa: BLE001 - the driver must still hear of the end (its slot stays taken)
            logger.exception("replica: releasing tenant %s failed", name)
        finally:
            self.moving.discard(name)
            with self.changed:
                self.ended.append(end)
                self.changed.notify_all()


class ReplicaRunner:
    """The body of one replica's actor (see the module docstring). ``run`` is the replica's one-replica run (its
    start-time tenants, its output folder, the shared checkpoint folder), ``resume`` its tenants' checkpoints and
    ``envs`` the driver's skyrl-gym environments (id -> EnvSpec), registered here where this process lacks them."""

    def __init__(self, run: RunConfig, resume: dict[str, TenantCheckpoint], envs: dict[str, Any]) -> None:
        from skyrl_gym.envs.registration import register, registry

        for env_id, spec in envs.items():
            if env_id not in registry:
                register(env_id, entry_point=spec.entry_point, kwargs=spec.kwargs)
        self.run = run
        self._host = _Host()
        self._error: BaseException | None = None
        self._summary: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._main, args=(resume,), name="replica-run", daemon=True)
        self._thread.start()

    def _main(self, resume: dict[str, TenantCheckpoint]) -> None:
        try:  # whatever fails here, the imports included, ends the run with its error: served and done are set below
            from skyrl_clora.backends.embedded.backend import run_experiments
            from skyrl_clora.base_model import prompt_tokenizer
            from skyrl_clora.metrics import summarize_pool
            from skyrl_clora.recipes.plugin import build_task_sources

            sources = build_task_sources(self.run.recipe, list(self.run.tenants), self.run.max_training_steps,
                                         self.run.seed, prompt_tokenizer(self.run))
            self._summary = summarize_pool(self.run, lambda: run_experiments(self.run, sources, resume, [],
                                                                             host=self._host), 0.0)  # no base built
            if self._host.loop is None:  # no pool: its tenants were finished, or the signal came before they started
                self._report_unstarted(resume)
        except BaseException as error:  # noqa: BLE001 - handed to the driver by wait_ended and close
            self._error = error
        finally:
            with self._host.changed:
                self._host.done = True
                self._host.changed.notify_all()
            self._host.served.set()

    def _report_unstarted(self, resume: dict[str, TenantCheckpoint]) -> None:
        """Reports each unfinished tenant of the run as ``stopped`` at its checkpoint's step (0 without one): the
        run ended before its pool started, which with unfinished tenants only a signal forwarded before then does
        (``run_experiments`` then records them stopped and starts none)."""
        from skyrl_clora.control.interrupts import STOP

        unstarted = [TenantEnd(spec.name, "stopped", resume[spec.name].step if spec.name in resume else 0)
                     for spec in self.run.tenants if not (spec.name in resume and resume[spec.name].finished)]
        if unstarted and not STOP.requested():
            raise RuntimeError(f"replica {self.run.output_dir.name} ended without starting tenants "
                               f"{', '.join(end.tenant for end in unstarted)}")
        with self._host.changed:
            self._host.ended.extend(unstarted)

    def _call(self, coroutine: Any) -> Any:
        """Runs ``coroutine`` on the pool's event loop and returns its result (raises what it raises)."""
        host = self._host
        host.served.wait()
        if host.loop is None or host.done:
            coroutine.close()
            raise RuntimeError(f"replica {self.run.output_dir.name} runs no tenant pool (it ended or never started)")
        return asyncio.run_coroutine_threadsafe(coroutine, host.loop).result()

    def add(self, spec: TenantSpec, resume: TenantCheckpoint | None) -> None:
        """Starts tenant ``spec`` here, from its checkpoint ``resume`` when given (a tenant moved in). Waits until the
        replica's run serves its pool first, so that this thread imports and builds nothing while the run's thread
        is still importing the same modules."""
        self._host.served.wait()
        from skyrl_clora.base_model import prompt_tokenizer
        from skyrl_clora.recipes.plugin import build_task_sources

        source = build_task_sources(self.run.recipe, [spec], self.run.max_training_steps, self.run.seed,
                                    prompt_tokenizer(self.run))[spec.name]

        async def add() -> None:
            self._host.watch(spec.name, await self._host.pool.add(spec, source, resume))

        self._call(add())

    def stop(self, name: str, after_step: int | None = None, moving: bool = False) -> None:
        """Asks tenant ``name`` to stop (checkpointed) after its current step, or once it has done ``after_step`` RL
        steps; ``moving``: it goes on elsewhere (its records leave this replica's metrics log when it stops)."""

        async def stop() -> None:
            self._host.pool.stop(name, after_step)
            if moving:
                self._host.moving.add(name)

        self._call(stop())

    def interrupt(self, number: int) -> None:
        """The driver received signal ``number``: every tenant here, and any added later, stops after its current
        step (checkpointed, exported, a ``stopped`` record), as in a one-replica run that received it."""
        from skyrl_clora.control.interrupts import STOP

        STOP.request(number)

    def progress(self) -> dict[str, int]:
        """The RL steps done by each tenant running here."""

        async def progress() -> dict[str, int]:
            return await self._host.pool.steps_done()

        return self._call(progress())

    def step_seconds(self) -> dict[str, float]:
        """The mean wall time of an RL step of each tenant running here that has done one (its records carried
        from earlier replicas included): :func:`~skyrl_clora.placement.planner.step_seconds`."""
        from skyrl_clora.placement.planner import step_seconds

        async def seconds() -> dict[str, float]:
            running = set(self._host.pool.running())
            return {name: value for name, value in step_seconds(self._host.pool.metrics.records).items()
                    if name in running}

        return self._call(seconds())

    def wait_ended(self, seen: int) -> list[TenantEnd]:
        """Blocks until more than ``seen`` tenant loops ended here (or the run ended); returns those after the
        first ``seen``. Raises the run's error if it failed."""
        host = self._host
        with host.changed:
            host.changed.wait_for(lambda: len(host.ended) > seen or host.done)
            if self._error is not None:
                raise self._error
            return host.ended[seen:]

    def close(self) -> dict[str, Any]:
        """Ends the replica's run (no tenant runs here: every one ended or moved out); returns its summary."""
        host = self._host
        host.served.wait()
        if host.loop is not None and not host.done:
            host.loop.call_soon_threadsafe(host.closing.set)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._summary
