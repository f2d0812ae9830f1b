"""Which replica runs which tenant: a makespan plan over tenants' costs.

A replica (one copy of the base model with its engine, trainer and AdapterStore: one GPU) runs its tenants
concurrently; with a few tenants it is saturated (RESULTS.md: at N=8 the H200's engine and trainer work add
up to more than the wall time), so its wall time is about the sum of its tenants' work. The plan balances
that sum across replicas (P||Cmax, the makespan of identical machines) under a per-replica limit of tenants
(adapter slots, KV rows): greedy longest-first, then exchanges of up to two tenants between the most loaded
replica and another while one lowers the makespan, then a branch and bound from that plan (exact on small
cases, within a node budget on large ones). :func:`optimal_assignment` solves small cases exactly,
to measure the plan against. While the tenants run, :func:`pick_move` chooses the tenant to move onto a
replica that ran out of tenants.

A tenant's cost is its work left: :func:`estimated_cost` before it has run, and once it has,
:func:`measured_costs`: its measured seconds per RL step (:func:`step_seconds`, from its metrics records) times
its steps left, the estimates of the tenants not measured yet scaled to seconds by the tenants that have both.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


_MARGIN = 1e-9
SEARCH_NODES = 200_000  # the branch and bound's budget: exact for up to about a dozen tenants


@dataclass(frozen=True)
class TenantCost:
    """A tenant's work on a replica, in any unit that is the same for all tenants of one plan (seconds
    measured, or token positions estimated: :func:`estimated_cost`)."""

    name: str
    work: float


def estimated_cost(name: str, steps: int, rows_per_step: int, positions_per_row: int) -> TenantCost:
    """The work of ``steps`` steps of ``rows_per_step`` rows (prompts x samples), each up to ``positions_per_row``
    prompt and generated positions, in token positions: what sampling and training both scale with."""
    return TenantCost(name, float(steps * rows_per_step * positions_per_row))


STEP_TIMINGS = ("rollout_s", "train_s", "sync_s")  # the parts of an RL step's wall time in its metrics record


def step_seconds(records: Iterable[Mapping[str, object]]) -> dict[str, float]:
    """Per tenant with at least one RL step record in ``records``, the mean wall time of those steps (the sum of
    each record's :data:`STEP_TIMINGS`)."""
    totals: dict[str, list[float]] = {}
    for record in records:
        if record.get("event") == "step" and all(isinstance(record.get(key), (int, float)) for key in STEP_TIMINGS):
            total = totals.setdefault(str(record["tenant"]), [0.0, 0.0])
            total[0] += sum(float(record[key]) for key in STEP_TIMINGS)
            total[1] += 1
    return {name: seconds / count for name, (seconds, count) in totals.items()}


def measured_costs(per_step: Sequence[TenantCost], steps_left: Mapping[str, int],
                   seconds: Mapping[str, float]) -> list[TenantCost]:
    """Each tenant's work left, ``steps_left[name]`` steps of: its measured ``seconds[name]`` per step where
    given; else its estimated work per step (``per_step``, :func:`estimated_cost` of one step) times the seconds
    per estimated unit of the measured tenants (their seconds over their estimates, summed). With no tenant
    measured (or none with a non-zero estimate), every tenant's estimate."""
    measured = [cost for cost in per_step if cost.name in seconds]
    units = sum(cost.work for cost in measured)
    if units <= 0:
        return [TenantCost(cost.name, cost.work * steps_left[cost.name]) for cost in per_step]
    scale = sum(seconds[cost.name] for cost in measured) / units
    return [TenantCost(cost.name, steps_left[cost.name] * (seconds[cost.name] if cost.name in seconds
                                                           else cost.work * scale)) for cost in per_step]


def makespan(assignment: Sequence[Sequence[str]], costs: dict[str, float]) -> float:
    """The largest replica load of ``assignment`` (one list of tenant names per replica)."""
    return max((sum(costs[name] for name in names) for names in assignment), default=0.0)


def plan_assignment(tenants: Sequence[TenantCost], replicas: int, capacity: int) -> list[list[str]]:
    """Assigns every tenant to one of ``replicas`` replicas, at most ``capacity`` tenants each, so that the
    makespan is small: longest first onto the least loaded replica with room, then exchanges of up to two
    tenants (moves included) between the most loaded replica and another while one lowers the makespan, then
    :func:`_search` from there. Deterministic (ties go to the lower replica index and the tenant order given). Raises ValueError when the tenants do
    not fit ``replicas * capacity``."""
    if replicas < 1 or capacity < 1:
        raise ValueError(f"need at least one replica and one tenant per replica, got {replicas} and {capacity}")
    if len(tenants) > replicas * capacity:
        raise ValueError(f"{len(tenants)} tenants do not fit {replicas} replicas of {capacity} tenants each")
    costs = {tenant.name: tenant.work for tenant in tenants}
    if len(costs) != len(tenants):
        raise ValueError("tenant names must be unique")
    assignment: list[list[str]] = [[] for _ in range(replicas)]
    loads = [0.0] * replicas
    for tenant in sorted(tenants, key=lambda t: -t.work):  # sorted() is stable: ties keep the given order
        open_replicas = [r for r in range(replicas) if len(assignment[r]) < capacity]
        target = min(open_replicas, key=lambda r: (loads[r], r))
        assignment[target].append(tenant.name)
        loads[target] += tenant.work
    while _improve(assignment, costs, capacity):
        pass
    assignment = _search(tenants, replicas, capacity, assignment, costs)
    order = {tenant.name: index for index, tenant in enumerate(tenants)}
    return [sorted(names, key=order.__getitem__) for names in assignment]


def _improve(assignment: list[list[str]], costs: dict[str, float], capacity: int) -> bool:
    """Applies the first exchange of up to two tenants of the most loaded replica for up to two of another
    (a move when none come back) that leaves both below the makespan; False when none does."""
    loads = [sum(costs[name] for name in names) for names in assignment]
    top = max(range(len(assignment)), key=lambda r: (loads[r], -r))
    bound = loads[top] * (1 - _MARGIN)  # a change must beat the makespan by more than rounding (no cycles on ties)
    for other in range(len(assignment)):
        if other == top:
            continue
        for given in _groups(assignment[top], 1):
            for taken in _groups(assignment[other], 0):
                delta = sum(costs[name] for name in given) - sum(costs[name] for name in taken)
                room = (len(assignment[other]) - len(taken) + len(given) <= capacity
                        and len(assignment[top]) - len(given) + len(taken) <= capacity)
                if delta > 0 and room and loads[other] + delta < bound:
                    assignment[top] = [name for name in assignment[top] if name not in given] + list(taken)
                    assignment[other] = [name for name in assignment[other] if name not in taken] + list(given)
                    return True
    return False


def _groups(names: list[str], smallest: int) -> list[tuple[str, ...]]:
    """Every group of ``smallest`` to two of ``names``, in order."""
    return [group for size in range(smallest, 3) for group in itertools.combinations(names, size)]


def _search(tenants: Sequence[TenantCost], replicas: int, capacity: int, incumbent: list[list[str]],
            costs: dict[str, float]) -> list[list[str]]:
    """Depth-first branch and bound from ``incumbent``: tenants longest first onto each replica in turn (replicas
    of equal load and count tried once), cut where a load reaches the best makespan found or the remaining work
    spread evenly cannot beat it. Exact when it ends within :data:`SEARCH_NODES` nodes (small cases); else the
    best assignment found by then."""
    ordered = sorted(tenants, key=lambda t: -t.work)
    suffix = [0.0] * (len(ordered) + 1)
    for index in range(len(ordered) - 1, -1, -1):
        suffix[index] = suffix[index + 1] + ordered[index].work
    best = [makespan(incumbent, costs) * (1 - _MARGIN), incumbent]
    loads, members = [0.0] * replicas, [[] for _ in range(replicas)]
    nodes = 0

    def place(index: int) -> None:
        nonlocal nodes
        nodes += 1
        if nodes > SEARCH_NODES:
            return
        if index == len(ordered):
            best[:] = [max(loads) * (1 - _MARGIN), [list(names) for names in members]]
            return
        if max(max(loads), (sum(loads) + suffix[index]) / replicas) >= best[0]:
            return
        work, tried = ordered[index].work, set()
        for replica in sorted(range(replicas), key=lambda r: (loads[r], r)):
            state = (loads[replica], len(members[replica]))
            if state in tried or len(members[replica]) >= capacity or loads[replica] + work >= best[0]:
                continue
            tried.add(state)
            loads[replica] += work
            members[replica].append(ordered[index].name)
            place(index + 1)
            members[replica].pop()
            loads[replica] -= work

    place(0)
    return best[1]


def pick_move(loads: Sequence[Sequence[TenantCost]], to: int, capacity: int) -> tuple[str, int] | None:
    """The tenant to move onto replica ``to`` while the tenants run, and the replica it leaves: ``loads`` holds
    per replica its unfinished tenants, each with its work after its current step (a tenant moves at a step
    boundary; one with no work left after its current step does not move). Of the tenants of replicas holding
    at least two, the one whose move leaves the lower of the two replicas' larger load, when that is below
    their larger load now and ``to`` holds fewer than ``capacity`` tenants; None when no move helps. Ties go to
    the lower replica index, then the order given."""
    if len(loads[to]) >= capacity:
        return None
    totals = [sum(cost.work for cost in costs) for costs in loads]
    best: tuple[float, str, int] | None = None
    for source, costs in enumerate(loads):
        if source == to or len(costs) < 2:
            continue
        for cost in costs:
            after = max(totals[source] - cost.work, totals[to] + cost.work)
            if cost.work > 0 and after < max(totals[source], totals[to]) * (1 - _MARGIN) \
                    and (best is None or after < best[0] * (1 - _MARGIN)):
                best = (after, cost.name, source)
    return None if best is None else (best[1], best[2])


def optimal_assignment(tenants: Sequence[TenantCost], replicas: int, capacity: int) -> tuple[float, list[list[str]]]:
    """The least makespan over every assignment (``replicas ** len(tenants)`` of them: small cases only) and one
    assignment that reaches it."""
    costs = {tenant.name: tenant.work for tenant in tenants}
    best: tuple[float, list[list[str]]] = (float("inf"), [])
    for choice in itertools.product(range(replicas), repeat=len(tenants)):
        assignment: list[list[str]] = [[] for _ in range(replicas)]
        for tenant, replica in zip(tenants, choice):
            assignment[replica].append(tenant.name)
        if any(len(names) > capacity for names in assignment):
            continue
        span = makespan(assignment, costs)
        if span < best[0]:
            best = (span, assignment)
    return best
