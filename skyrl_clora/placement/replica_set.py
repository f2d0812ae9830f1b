"""The driver's side of a replicated run: live replicas, which tenant each holds, and tenants moved between them.

Each replica is a :class:`~skyrl_clora.placement.replica_actor.ReplicaRunner` actor in its bundle of the run's
placement group. The driver waits on every replica's :meth:`~ReplicaRunner.wait_ended` at once and acts on what
ends:

- Moving a tenant: the source stops it at a step boundary (``stop(..., moving=True)``: it checkpoints its whole
  AdapterStore state, with its published version and records); once it reports ``stopped``, the destination adds
  it from that checkpoint (``add``) and the tenant goes on from the next step, as it would have where it was.
  A move is asked for explicitly (:class:`Move`, in order per tenant), or made by the driver when a replica has
  no tenant left to run while another runs at least two with work left after their current step: the planner's
  :func:`~skyrl_clora.placement.planner.pick_move` chooses which (by work left: measured seconds per step where
  the tenant has done one, :func:`~skyrl_clora.placement.planner.measured_costs`).
- Live control (``python -m skyrl_clora.ctl``; :mod:`.replica_control`): requests from other threads
  (:meth:`ReplicaSet.call`) run on the driver's thread between its waits; an added tenant starts on the live
  replica with room that runs the fewest tenants, a stop goes to the replica holding the tenant.
- A lost replica (its actor died) is relaunched in its bundle with the tenants it held, each from its latest
  checkpoint. One lost more than :data:`REPLICA_RESTARTS` times is given up: its unfinished tenants go on, each
  from its latest checkpoint (afresh without one), on the live replica with room that runs the fewest tenants
  (recorded in :attr:`ReplicaSet.moves`); one that finds no room waits until a tenant ends somewhere, and fails
  only when no live replica is left, or none runs a tenant that could free a slot. A move from a lost replica
  is dropped (an explicit one is asked again where the tenant goes on); a move to a replica lost for good goes
  back to its source.
- A signal to the driver (``control.interrupts.STOP``; the driver looks between its waits) is forwarded to every live
  replica (:meth:`~ReplicaRunner.interrupt`), relaunched ones included: each tenant stops after its current step
  as in a one-replica run. From then on no move starts and no tenant is added; a move under way lands (its tenant
  stops on its destination at once, checkpointed where it left).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from skyrl_clora.checkpoints import TenantCheckpoint, TenantCheckpoints
from skyrl_clora.config.schema import ConfigError, RunConfig
from skyrl_clora.control.interrupts import STOP
from skyrl_clora.placement.planner import TenantCost, estimated_cost, measured_costs, pick_move
from skyrl_clora.tenants import TenantSpec

POLL_S = 0.2  # the longest a control request, or a signal's stop, waits for the driver's thread
REPLICA_RESTARTS = 2  # a replica lost more often than this is given up: its tenants go on on the others


@dataclass(frozen=True)
class Move:
    """Move ``tenant`` to replica ``to`` once it has done ``after_step`` RL steps (None: after its current step)."""

    tenant: str
    to: int
    after_step: int | None = None


class ReplicaSet:
    """The live replicas of one run (see the module docstring). ``sub_runs[k]`` is replica ``k``'s run with its
    start-time tenants; ``capacity`` the tenants a replica holds at most; ``launch(k, run, resume)`` starts
    replica ``k``'s actor on ``run`` and returns its handle."""

    def __init__(self, run: RunConfig, root: Path, sub_runs: list[RunConfig], capacity: int, launch: Any) -> None:
        self.run, self.root, self.sub_runs, self.capacity, self._launch = run, root, sub_runs, capacity, launch
        self.specs = {spec.name: spec for sub in sub_runs for spec in sub.tenants}
        self.owner = {spec.name: index for index, sub in enumerate(sub_runs) for spec in sub.tenants}
        self.status = {name: "running" for name in self.owner}  # running | finished | failed | stopped
        self.actors: list[Any] = [None] * len(sub_runs)
        self.gone: set[int] = set()  # replicas lost for good
        self.losses = [0] * len(sub_runs)
        self.records: list[dict[str, Any]] = []  # failures the driver saw (lost replicas, refused moves)
        self.moves: list[dict[str, Any]] = []  # the moves done: tenant, from, to, step
        self._waits: dict[Any, int] = {}
        self._seen = [0] * len(sub_runs)
        self._queued: dict[str, deque[Move]] = {}
        self._moving: dict[str, Move] = {}  # tenants asked to stop for a move, by name
        self._requests: queue.Queue[tuple[Callable[[], Any], Future]] | None = None  # live control's, when served
        self._serving = False
        self._lock = threading.Lock()  # orders call's queueing against refuse_requests
        self._interrupted: int | None = None  # the signal forwarded to the replicas, once one came
        self._homeless: list[tuple[str, int]] = []  # tenants of replicas lost for good waiting for room: name, origin

    def run_all(self, resume: dict[str, TenantCheckpoint], moves: list[Move]) -> None:
        """Runs every tenant to its end (finished or failed), with ``moves`` asked for as each tenant gets there."""
        import ray

        for move in moves:
            if move.tenant not in self.specs:
                raise ConfigError(f"a move names tenant {move.tenant}, which no replica runs; name one of "
                                  f"{', '.join(self.specs)}")
            if not 0 <= move.to < len(self.sub_runs):
                raise ConfigError(f"a move of tenant {move.tenant} names replica {move.to}; the run has replicas "
                                  f"0..{len(self.sub_runs) - 1}")
            self._queued.setdefault(move.tenant, deque()).append(move)
        for index, sub in enumerate(self.sub_runs):
            self._start(index, sub, {n: c for n, c in resume.items() if n in {s.name for s in sub.tenants}})
        for name in list(self._queued):
            self._next_move(name)
        while self._waits and any(status == "running" for status in self.status.values()):
            if STOP.requested() and self._interrupted is None:
                self._interrupt(STOP.signal)
            done, _ = ray.wait(list(self._waits), num_returns=1, timeout=POLL_S)
            self._answer_requests()
            if not done:
                continue
            index = self._waits.pop(done[0])
            try:
                ended = ray.get(done[0])
            except ray.exceptions.RayActorError as error:
                self._lost(index, error)
                continue
            if ended:
                self._seen[index] += len(ended)
                self._waits[self.actors[index].wait_ended.remote(self._seen[index])] = index
            else:  # the replica's run ended on its own: it had no tenant left to run
                self._unreported(index)
            for end in ended:
                self._ended(index, end.tenant, end.outcome, end.step)
            if self._homeless:
                self._rehome()
            self._rebalance()

    def serve_requests(self) -> None:
        """From now until :meth:`close`, :meth:`call` runs requests on the driver's thread."""
        self._requests, self._serving = queue.Queue(), True

    def call(self, request: Callable[[], Any]) -> Any:
        """Runs ``request`` on the driver's thread between its waits (from another thread) and returns its result
        or raises its error; a :class:`ConfigError` once the run is ending."""
        future: Future = Future()
        with self._lock:
            if self._requests is None or not self._serving:
                raise ConfigError("the run is ending: it takes no more requests")
            self._requests.put((request, future))
        return future.result()

    def _answer_requests(self) -> None:
        while self._requests is not None and not self._requests.empty():
            request, future = self._requests.get_nowait()
            try:
                future.set_result(request())
            except Exception as error:  # noqa: BLE001 - the requester gets it
                future.set_exception(error)

    def add_tenant(self, spec: TenantSpec) -> None:
        """(Driver's thread.) Starts tenant ``spec`` afresh on the live replica with room running the fewest."""
        if self._interrupted is not None:
            raise ConfigError("the run is stopping on a signal; add the tenant once the same command resumes the run")
        room = self._with_room()
        if not room:
            raise ConfigError(f"every replica holds {self.capacity} tenants, the most this run gives one (clora.max_tenants="
                              f"{self.run.max_tenants}); start the run with a larger clora.max_tenants")
        index = room[0]
        self.specs[spec.name], self.status[spec.name] = spec, "running"
        error = self._add(index, spec.name, None)
        if error is not None:
            del self.specs[spec.name], self.status[spec.name], self.owner[spec.name]
            raise ConfigError(error)

    def _with_room(self) -> list[int]:
        """The live replicas holding fewer than ``capacity`` running or arriving tenants, fewest first (ties: the
        lower index)."""
        arriving = [move.to for move in self._moving.values()]
        load = {index: sum(self.status[name] == "running" for name in self._held(index)) + arriving.count(index)
                for index in range(len(self.sub_runs)) if index not in self.gone}
        return sorted((index for index, held in load.items() if held < self.capacity), key=lambda i: (load[i], i))

    def stop_tenant(self, name: str) -> None:
        """(Driver's thread.) Asks running tenant ``name`` to stop after its current step (it ends ``stopped``)."""
        import ray

        if self.status.get(name) != "running":
            running = [n for n, status in self.status.items() if status == "running"]
            raise ConfigError(f"tenant {name} is not running here; running: {', '.join(running) or 'none'}")
        if name in self._moving:
            raise ConfigError(f"tenant {name} is moving to another replica; stop it once it has moved (after its step)")
        self._queued.pop(name, None)
        try:
            ray.get(self.actors[self.owner[name]].stop.remote(name))
        except ray.exceptions.RayTaskError as error:
            raise ConfigError(str(error.cause if getattr(error, "cause", None) is not None else error)) from None

    def steps_done(self) -> dict[str, int]:
        """(Driver's thread.) The RL steps done by each running tenant, from the live replicas."""
        import ray

        done: dict[str, int] = {}
        for index, actor in enumerate(self.actors):
            if index not in self.gone and actor is not None:
                try:
                    done |= ray.get(actor.progress.remote())
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                    continue
        return done

    def refuse_requests(self) -> None:
        """Answers the requests still queued, and every later one, with a refusal (the run is ending)."""
        with self._lock:
            self._serving = False
            while self._requests is not None and not self._requests.empty():
                self._requests.get_nowait()[1].set_exception(ConfigError("the run is ending: it takes no more requests"))

    def close(self) -> None:
        """Refuses requests from now on, then ends every live replica's run (their metrics and summaries written)."""
        import ray

        self.refuse_requests()

        for index, actor in enumerate(self.actors):
            if index not in self.gone and actor is not None:
                try:
                    ray.get(actor.close.remote())
                except ray.exceptions.RayActorError:  # its tenants all ended: what they wrote is on disk
                    print(f"[replicas] replica {index} was lost while closing", file=sys.stderr)

    def _start(self, index: int, sub: RunConfig, resume: dict[str, TenantCheckpoint]) -> None:
        self.actors[index] = self._launch(index, sub, resume)
        self._seen[index] = 0
        self._waits[self.actors[index].wait_ended.remote(0)] = index
        if self._interrupted is not None:
            self.actors[index].interrupt.remote(self._interrupted)

    def _interrupt(self, number: int) -> None:
        """Forwards signal ``number`` to every live replica (see the module docstring)."""
        import ray

        self._interrupted = number
        self._queued.clear()
        calls = [actor.interrupt.remote(number) for index, actor in enumerate(self.actors)
                 if index not in self.gone and actor is not None]
        for call in calls:
            try:
                ray.get(call)
            except ray.exceptions.RayActorError:  # lost: its relaunch is interrupted as it starts
                pass
        print("[replicas] asked every replica's tenants to stop after their current step", file=sys.stderr)

    def abort(self) -> None:
        """Ends every replica at once (a second signal): what the tenants' last checkpoints hold is what a resume
        continues from."""
        import ray

        for actor in self.actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)

    def _unreported(self, index: int) -> None:
        """Replica ``index``'s run ended: a tenant it holds that is still running here was never reported ended (a
        breach of the replica's contract) and fails with a record, so that the run ends instead of waiting for it."""
        for name in self._held(index):
            if self.status[name] == "running":
                self.status[name] = "failed"
                self.records.append({"event": "failed", "tenant": name,
                                     "error": f"replica {index}'s run ended without reporting tenant {name}'s end"})

    def _held(self, index: int) -> list[str]:
        return [name for name, owner in self.owner.items() if owner == index]

    def _ended(self, index: int, name: str, outcome: str, step: int) -> None:
        """Tenant ``name``'s loop ended on replica ``index``: a move's first half lands it on its destination."""
        move = self._moving.pop(name, None)
        if move is None or outcome != "stopped":
            self.status[name] = outcome
            self._queued.pop(name, None)
            return
        to = move.to if move.to not in self.gone else index
        checkpoint = TenantCheckpoints(self.root, name, -1).latest() if step > 0 else None  # none before step 1
        if step > 0 and (checkpoint is None or checkpoint.step != step):
            raise RuntimeError(f"tenant {name} stopped after step {step} to move, but its latest checkpoint under "
                               f"{self.root} holds {checkpoint.step if checkpoint else 'no'} step(s)")
        error = self._add(to, name, checkpoint)
        if error is not None and to != index:  # the destination refused it: it goes on where it was
            print(f"[replicas] replica {to} refused tenant {name} ({error}); it stays on replica {index}",
                  file=sys.stderr)
            to, error = index, self._add(index, name, checkpoint)
        if error is not None:
            self.status[name] = "failed"
            self.records.append({"event": "failed", "tenant": name, "error": f"resuming on replica {to}: {error}"})
            return
        if to != index:
            self.moves.append({"tenant": name, "from": index, "to": to, "step": step})
            print(f"[replicas] tenant {name} moved from replica {index} to replica {to} after step {step}",
                  file=sys.stderr)
        self._next_move(name)

    def _add(self, index: int, name: str, checkpoint: TenantCheckpoint | None) -> str | None:
        """Starts tenant ``name`` on replica ``index`` from ``checkpoint`` (None: afresh), which then holds it;
        returns why the replica refused it, or None."""
        import ray

        self.owner[name] = index
        try:
            ray.get(self.actors[index].add.remote(self.specs[name], checkpoint))
        except ray.exceptions.RayActorError:  # replica index is lost: its relaunch resumes the tenant
            pass
        except ray.exceptions.RayTaskError as error:
            return str(error.cause if getattr(error, "cause", None) is not None else error).splitlines()[0]
        return None

    def _next_move(self, name: str) -> None:
        """Asks the replica holding ``name`` to stop it for its next queued move (moves to where it is are done)."""
        queue = self._queued.get(name)
        while queue and queue[0].to == self.owner[name]:
            queue.popleft()
        if queue and self.status[name] == "running" and self.owner[name] not in self.gone:
            self._stop_to_move(queue.popleft())

    def _stop_to_move(self, move: Move) -> bool:
        import ray

        if self._interrupted is not None:
            return False

        try:
            ray.get(self.actors[self.owner[move.tenant]].stop.remote(move.tenant, move.after_step, moving=True))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):  # lost, or the tenant just ended
            return False
        self._moving[move.tenant] = move
        return True

    def _lost(self, index: int, error: Exception) -> None:
        """Replica ``index``'s actor died: relaunches it with its tenants from their latest checkpoints, or (lost
        more than :data:`REPLICA_RESTARTS` times, or nothing left to run) gives it up, its unfinished tenants
        going on elsewhere (:meth:`_rehome`)."""
        self.losses[index] += 1
        held = self._held(index)
        for name in held:  # its stop requests died with it; explicit moves are asked again
            move = self._moving.pop(name, None)
            if move is not None and name in self._queued:
                self._queued[name].appendleft(move)
        if self.losses[index] > REPLICA_RESTARTS:
            self.gone.add(index)
            print(f"[replicas] replica {index} was lost {self.losses[index]} times ({type(error).__name__}); its "
                  "unfinished tenants go on elsewhere from their last checkpoints", file=sys.stderr)
            for name in held:
                if self.status[name] == "running" and _finished(self.root, name):
                    self.status[name] = "finished"
                elif self.status[name] == "running":
                    self._homeless.append((name, index))
            self._rehome()
            return
        latest = {name: checkpoint for name in held
                  if (checkpoint := TenantCheckpoints(self.root, name, -1).latest()) is not None}
        if all(name in latest and latest[name].finished for name in held):
            self.gone.add(index)  # its tenants finished: their records are in its metrics already
            return
        print(f"[replicas] replica {index} was lost; its tenants resume from their last checkpoints", file=sys.stderr)
        for name in held:
            self.status[name] = "finished" if name in latest and latest[name].finished else "running"
        sub = replace(self.sub_runs[index], tenants=tuple(self.specs[name] for name in held))
        self._start(index, sub, latest)
        for name in held:
            self._next_move(name)

    def _rehome(self) -> None:
        """Starts each tenant of a replica lost for good on the live replica with room running the fewest tenants,
        from its latest checkpoint; keeps those no replica took waiting, or fails them when no live replica is
        left or none runs a tenant (no slot will free)."""
        waiting = []
        for name, origin in self._homeless:
            checkpoint = TenantCheckpoints(self.root, name, -1).latest()
            for to in self._with_room():
                error = self._add(to, name, checkpoint)
                if error is None:
                    step = checkpoint.step if checkpoint is not None else 0
                    self.moves.append({"tenant": name, "from": origin, "to": to, "step": step})
                    print(f"[replicas] tenant {name} of lost replica {origin} goes on on replica {to} after step "
                          f"{step}", file=sys.stderr)
                    self._next_move(name)
                    break
                self.owner[name] = origin
                print(f"[replicas] replica {to} refused tenant {name} ({error})", file=sys.stderr)
            else:
                waiting.append((name, origin))
        self._homeless = waiting
        busy = any(status == "running" and self.owner[name] not in self.gone for name, status in self.status.items())
        if waiting and not busy:
            for name, origin in waiting:
                self.status[name] = "failed"
                self.records.append({"event": "failed", "tenant": name, "error": f"replica {origin} lost "
                                     f"{self.losses[origin]} times and no live replica could take the tenant"})
            self._homeless = []

    def _rebalance(self) -> None:
        """Moves a tenant onto each live replica that has none left to run, where the planner finds one that helps
        (none once the run is stopping on a signal)."""
        import ray

        if self._interrupted is not None:
            return

        live = [index for index in range(len(self.sub_runs)) if index not in self.gone]
        arriving = {move.to for move in self._moving.values()}
        running = {index: [name for name in self._held(index) if self.status[name] == "running"] for index in live}
        for idle in [index for index in live if not running[index] and index not in arriving]:
            done: dict[int, dict[str, int]] = {}
            seconds: dict[str, float] = {}
            for index in live:
                movable = [n for n in running[index] if n not in self._moving and not self._queued.get(n)]
                if index == idle or len(movable) < 2:
                    continue
                try:
                    progress, measured = ray.get([self.actors[index].progress.remote(),
                                                  self.actors[index].step_seconds.remote()])
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                    continue
                done[index] = {name: progress[name] for name in movable if name in progress}
                seconds |= measured
            costs = {cost.name: cost for cost in self._work_after_current(done, seconds)}
            loads = [[costs[name] for name in done.get(index, {})] for index in range(len(self.sub_runs))]
            choice = pick_move(loads, idle, self.capacity)
            if choice is not None and self._stop_to_move(Move(choice[0], idle)):
                running[choice[1]].remove(choice[0])

    def _work_after_current(self, done: dict[int, dict[str, int]], seconds: dict[str, float]) -> list[TenantCost]:
        """The work after their current step of the tenants in ``done`` (per replica, each tenant's RL steps done):
        :func:`~skyrl_clora.placement.planner.measured_costs` with the measured ``seconds`` per step."""
        run = self.run
        names = [name for held in done.values() for name in held]
        positions = run.recipe.max_input_length + run.recipe.max_generate_length
        per_step = [estimated_cost(name, 1, run.recipe.prompts_per_step * self.specs[name].samples_per_prompt,
                                   positions) for name in names]
        steps_left = {name: max(0, run.steps - steps - 1) for held in done.values() for name, steps in held.items()}
        return measured_costs(per_step, steps_left, seconds)

def _finished(root: Path, name: str) -> bool:
    latest = TenantCheckpoints(root, name, -1).latest()
    return latest is not None and latest.finished

