"""Which tenants train together in packed mode: a cost model of one packed pass and a plan of a round's passes.

A round trains every waiting tenant once, in passes of at most ``pack_size`` tenants (the trainer's slots).
:class:`PackCostModel` prices one pass over a set of tenants from what is known of each (:class:`PackLoad`: its
batch's rows, their prompt and response lengths and GRPO groups, its LoRA rank)::

    pass_s = PASS_S + update_epochs * sum over the pass's optimizer steps k of
                 (MICRO_BATCH_S * micro_batches_k + token_s(rank) * tokens_k)
             [+ FORWARD_SHARE * (the same over one scoring forward of every row), when a tenant needs it]
    token_s(rank) = TOKEN_S * (1 + LORA_SHARE * (rank / REFERENCE_RANK - 1))

where step ``k`` trains every tenant's ``k``-th policy mini-batch, its micro-batches are those the trainer
plans (:func:`plan_micro_batches` on the tenants' rows, interleaved by prompt group, cut by rows or by the token
budget) and ``tokens_k`` the token positions they compute: each row padded to its micro-batch's longest
sequence, or with shared prompts each distinct prompt once plus every response. The rows go in batch order
(the trainer shuffles each tenant's prompt groups with its own RNG, which the plan must not draw from), so
micro-batch counts and padding are estimates of the trainer's. ``rank``: the slots' rank when the kernels run
every slot at one rank (the embedded trainer: its store's max rank; the plan is then blind to ranks), else the
pass's largest tenant rank (kernels that pad a pass to its largest rank). KL passes are not modelled.

Constants (``benchmarks.train``, RESULTS.md "Training: packed vs swap", H200, Qwen3-1.7B shape, rank 16):
``PASS_S``, ``MICRO_BATCH_S`` and ``TOKEN_S`` are the least-squares fit (relative error) of the model to that
table's six rounds of 8 tenants -- swap and packed on the small workload, swap and packed on gsm8k with whole
sequences, swap with shared prompts at 32- and 64-row micro-batches -- with each round's micro-batches and tokens
counted from its workload's lengths. The trainer is host-bound there: a micro-batch's launches cost as much as
``MICRO_BATCH_S / TOKEN_S`` tokens. ``LORA_SHARE`` is an estimate, not a measurement: the packed LoRA op's
forward and backward of 4096 tokens at rank 16, hidden 4096 (RESULTS.md, Training: packed vs swap, the kernel's
graph replay) against that layer's base GEMMs (6 * 4096^3 FLOPs at the H200's bf16 peak). ``FORWARD_SHARE``: a forward is
about a third of a forward and backward (2 of 6 FLOPs per weight).

:func:`plan_packs` partitions a round's tenants into passes minimizing the round's summed pass seconds: two
greedy starts (like lengths cut into full passes; best fit by marginal cost), exchanges of up to two tenants
between passes while one lowers the total, then an exact search over subsets on small rounds, or exact
re-partitions of two or three passes at a time on larger ones. :func:`optimal_packs` enumerates every partition
(small cases only), to measure the plan against.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from skyrl_clora.trainer.batch import TrainBatch, mini_batch_rows, plan_micro_batches

PASS_S = 0.08  # seconds per pass: swap-in/out of its tenants, optimizer steps, the pass's host work
MICRO_BATCH_S = 0.2  # seconds per micro-batch: its forward/backward's host launches
TOKEN_S = 5.8e-6  # seconds per token position computed (forward + backward) at REFERENCE_RANK
LORA_SHARE = 0.1  # the LoRA part of TOKEN_S at REFERENCE_RANK; it scales with the rank
REFERENCE_RANK = 16
FORWARD_SHARE = 1 / 3  # a scoring forward's cost relative to a forward and backward
SEARCH_STEPS = 150_000  # the exact search runs when its subset transitions stay within this (about 10 tenants)
IMPROVE_EVALUATIONS = 1_500  # the exchanges stop after pricing this many distinct passes (bounds the plan's time)
SEARCHES = ("exact", "repartition", "exchanges")  # plan_packs's search levels, most thorough first
_MARGIN = 1e-9


@dataclass(frozen=True)
class PackLoad:
    """One tenant's batch as the cost model sees it: per row its prompt and response lengths and GRPO group,
    the tenant's LoRA rank, and whether its pass runs a scoring forward first (``scores``: it takes more than
    one optimizer step and its batch has no behaviour log-probs)."""

    name: str
    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    groups: tuple[str, ...]
    rank: int
    scores: bool = False

    @property
    def mean_length(self) -> float:
        rows = len(self.prompt_lens)
        return (sum(self.prompt_lens) + sum(self.response_lens)) / rows if rows else 0.0


def pack_load(name: str, batch: TrainBatch, rank: int, mini_batch_prompts: int = 0, update_epochs: int = 1) -> PackLoad:
    """The :class:`PackLoad` of ``batch`` (an invalid batch gives the rows it has: it fails when trained)."""
    rows = list(zip(batch.prompt_ids, batch.response_ids, batch.group_ids))
    steps = len(mini_batch_rows([group for _, _, group in rows], mini_batch_prompts)) * update_epochs
    return PackLoad(name, tuple(len(p) for p, _, _ in rows), tuple(len(r) for _, r, _ in rows),
                    tuple(str(g) for _, _, g in rows), rank, scores=steps > 1 and batch.old_logprobs is None)


@dataclass
class _Rows:
    """:class:`~skyrl_clora.trainer.batch.RowLengths` of a pass built from lengths alone."""

    host_seq_lens: list[int]
    host_response_lens: list[int]
    prompt_groups: list[int]
    offsets: list[int]


@dataclass(frozen=True)
class PackCostModel:
    """Seconds of one packed pass (module docstring), under the trainer's micro-batch settings:
    ``micro_batch_size`` rows, or ``max_tokens > 0`` token positions, per micro-batch; ``shared_prompts``: a
    micro-batch computes each distinct prompt once; ``mini_batch_prompts`` / ``update_epochs``: SkyRL's policy
    mini-batches and epochs; ``slot_rank``: the rank every slot computes at (None: the pass's largest rank)."""

    micro_batch_size: int = 32
    max_tokens: int = -1
    shared_prompts: bool = False
    mini_batch_prompts: int = 0
    update_epochs: int = 1
    slot_rank: int | None = None
    pass_s: float = PASS_S
    micro_batch_s: float = MICRO_BATCH_S
    token_s: float = TOKEN_S
    lora_share: float = LORA_SHARE

    def pass_seconds(self, loads: Sequence[PackLoad]) -> float:
        """The modelled seconds of one pass over ``loads`` (in the pass's tenant order); 0 for no tenants."""
        if not loads:
            return 0.0
        rank = self.slot_rank if self.slot_rank is not None else max(load.rank for load in loads)
        token_s = self.token_s * (1 + self.lora_share * (rank / REFERENCE_RANK - 1))
        group_ids: dict[tuple[int, str], int] = {}
        rows = _Rows([], [], [], [])
        for index, load in enumerate(loads):
            rows.offsets.append(len(rows.host_seq_lens))
            rows.host_seq_lens.extend(p + r for p, r in zip(load.prompt_lens, load.response_lens))
            rows.host_response_lens.extend(load.response_lens)
            rows.prompt_groups.extend(group_ids.setdefault((index, group), len(group_ids)) for group in load.groups)
        minis = [mini_batch_rows(list(load.groups), self.mini_batch_prompts) for load in loads]
        steps = sum(self._work(rows, [m[k] if k < len(m) else [] for m in minis], token_s)
                    for k in range(max(map(len, minis))))
        seconds = self.pass_s + self.update_epochs * steps
        if any(load.scores for load in loads):
            seconds += FORWARD_SHARE * self._work(rows, [list(range(len(load.prompt_lens))) for load in loads], token_s)
        return seconds

    def _work(self, rows: _Rows, orders: list[list[int]], token_s: float) -> float:
        """Micro-batch and token seconds of one forward/backward over the rows ``orders`` (per tenant, local)."""
        if not any(orders):
            return 0.0
        order, micro_batches = plan_micro_batches(rows, orders, self.micro_batch_size, self.max_tokens,
                                                  self.shared_prompts)
        tokens = 0
        for micro in micro_batches:
            chunk = order[micro.start : micro.end]
            if self.shared_prompts:
                prompts = {rows.prompt_groups[row]: rows.host_seq_lens[row] - rows.host_response_lens[row] for row in chunk}
                tokens += sum(prompts.values()) + sum(rows.host_response_lens[row] for row in chunk)
            else:
                tokens += len(chunk) * micro.width
        return self.micro_batch_s * len(micro_batches) + token_s * tokens


class _Priced:
    """Pass seconds by member set (a tuple of ascending load indices), each priced once."""

    def __init__(self, loads: Sequence[PackLoad], model: PackCostModel) -> None:
        self.loads, self.model, self.cache = loads, model, {}

    def __call__(self, members: Sequence[int]) -> float:
        key = tuple(sorted(members))
        if key not in self.cache:
            self.cache[key] = self.model.pass_seconds([self.loads[i] for i in key])
        return self.cache[key]

    def total(self, passes: Sequence[Sequence[int]]) -> float:
        return sum(self(members) for members in passes)


def round_seconds(passes: Sequence[Sequence[str]], loads: Sequence[PackLoad], model: PackCostModel) -> float:
    """The modelled seconds of a round trained as ``passes`` (tenant names; each pass in the loads' order)."""
    index = {load.name: i for i, load in enumerate(loads)}
    return _Priced(loads, model).total([[index[name] for name in names] for names in passes])


def plan_packs(loads: Sequence[PackLoad], pack_size: int, model: PackCostModel, search: str = "exact") -> list[list[str]]:
    """Partitions the tenants of ``loads`` into passes of at most ``pack_size`` so that the round's modelled
    seconds (:func:`round_seconds`) are small:

    1. Two starts: tenants by mean sequence length, longest first (ties: larger rank, then the order given), cut
       into full passes (the fewest passes, each of like lengths: less padding); and tenants by tokens, largest
       first, each into the pass it makes the least dearer (a pass of its own included).
    2. From each start, while one lowers the total by more than rounding: the first exchange of one or two
       tenants of a pass for up to two of another pass (a move when none come back; a pass of their own
       included). The better result goes on.
    3. ``search="exact"`` (the default), when the subset transitions stay within :data:`SEARCH_STEPS` (about
       ten tenants at pack size 4): the exact optimum over all partitions (each remaining set's best partition
       computed once), kept only if it beats step 2 by more than rounding. Otherwise (and with
       ``search="repartition"``): while one lowers the total, the first two, else three, passes whose tenants'
       exact best partition beats them are re-partitioned so. ``search="exchanges"`` stops after step 2.

    Steps 2 and 3 stop pricing new passes after :data:`IMPROVE_EVALUATIONS` of them (large rounds). Deterministic:
    a function of the loads, their order, ``pack_size`` and ``model``. Each pass lists its tenants in the order
    given; passes are ordered by their first tenant. Raises ValueError on ``pack_size < 1``, repeated names or
    an unknown ``search``."""
    if pack_size < 1:
        raise ValueError(f"pack_size must be at least 1, got {pack_size}")
    if search not in SEARCHES:
        raise ValueError(f"search={search!r} is unknown; use {', '.join(SEARCHES)}")
    if len({load.name for load in loads}) != len(loads):
        raise ValueError("tenant names must be unique")
    if not loads:
        return []
    priced = _Priced(loads, model)
    order = sorted(range(len(loads)), key=lambda i: (-loads[i].mean_length, -loads[i].rank, i))
    passes = None
    for start in ([order[first : first + pack_size] for first in range(0, len(order), pack_size)],
                  _best_fit(loads, pack_size, priced)):
        while _improve(start, priced, pack_size):
            pass
        if passes is None or priced.total(start) < priced.total(passes) * (1 - _MARGIN):
            passes = start
    if search == "exact" and _search_steps(len(loads), pack_size) <= SEARCH_STEPS:
        seconds, best = _exact(list(range(len(loads))), pack_size, priced)
        if seconds < priced.total(passes) * (1 - _MARGIN):
            passes = best
    elif search != "exchanges":
        while _repartition(passes, priced, pack_size):
            pass
    ordered = sorted((sorted(members) for members in passes), key=lambda members: members[0])
    return [[loads[i].name for i in members] for members in ordered]


def _best_fit(loads: Sequence[PackLoad], pack_size: int, priced: _Priced) -> list[list[int]]:
    """Tenants by rows x mean length, largest first (ties: the order given), each into the pass with room that
    its joining makes the least dearer, a pass of its own included (ties: the earliest pass)."""
    passes: list[list[int]] = []
    for i in sorted(range(len(loads)), key=lambda i: (-len(loads[i].prompt_lens) * loads[i].mean_length, i)):
        options = [p for p in passes if len(p) < pack_size] + [[]]
        target = min(options, key=lambda p: priced(p + [i]) - priced(p))
        if not target:
            passes.append(target)
        target.append(i)
    return passes


def _improve(passes: list[list[int]], priced: _Priced, pack_size: int) -> bool:
    """Applies the first exchange of one or two tenants of a pass for up to two of another pass, or of a pass of
    their own (a move when none come back), that lowers the total; False when none does (or the pricing budget
    is spent)."""
    if len(passes) < sum(map(len, passes)):
        passes.append([])  # a pass of their own for moved tenants; dropped again if it stays empty
    try:
        for i, j in itertools.permutations(range(len(passes)), 2):
            before = priced(passes[i]) + priced(passes[j])
            bound = before - _MARGIN * max(before, 1.0)
            for given in _groups(passes[i], 1):
                if len(priced.cache) >= IMPROVE_EVALUATIONS:
                    return False
                kept = [x for x in passes[i] if x not in given]
                for taken in _groups(passes[j], 0):
                    if max(len(passes[j]) - len(taken) + len(given), len(kept) + len(taken)) > pack_size:
                        continue
                    left = [x for x in passes[j] if x not in taken]
                    if priced(kept + list(taken)) + priced(left + list(given)) < bound:
                        passes[i], passes[j] = kept + list(taken), left + list(given)
                        return True
        return False
    finally:
        passes[:] = [members for members in passes if members]


def _groups(members: list[int], smallest: int) -> list[tuple[int, ...]]:
    """Every group of ``smallest`` to two of ``members``, in order."""
    return [group for size in range(smallest, 3) for group in itertools.combinations(members, size)]


def _search_steps(tenants: int, pack_size: int) -> int:
    """An upper bound on the exact search's subset transitions: every remaining set times the passes holding
    its first tenant."""
    return 2 ** tenants * sum(math.comb(tenants - 1, size) for size in range(min(pack_size, tenants)))


def _exact(members: list[int], pack_size: int, priced: _Priced) -> tuple[float, list[list[int]]]:
    """The least total seconds over every partition of ``members`` into passes of at most ``pack_size``, and one
    partition that reaches it: the best partition of each remaining set is its first tenant's pass (each subset
    of the rest, in order) plus the best partition of what is left, computed once per set (a bit mask over
    ``members``)."""
    best: dict[int, tuple[float, list[list[int]]]] = {0: (0.0, [])}

    def solve(remaining: int) -> tuple[float, list[list[int]]]:
        if remaining in best:
            return best[remaining]
        positions = [k for k in range(len(members)) if remaining >> k & 1]
        first, rest = positions[0], positions[1:]
        found: tuple[float, list[list[int]]] = (math.inf, [])
        for size in range(min(pack_size, len(positions))):
            for others in itertools.combinations(rest, size):
                group = [first, *others]
                seconds, passes = solve(remaining & ~sum(1 << k for k in group))
                seconds += priced([members[k] for k in group])
                if seconds < found[0] * (1 - _MARGIN):
                    found = (seconds, [[members[k] for k in group], *passes])
        best[remaining] = found
        return found

    return solve((1 << len(members)) - 1)


def _repartition(passes: list[list[int]], priced: _Priced, pack_size: int) -> bool:
    """Replaces the first two, else three, passes whose tenants' exact best partition (:func:`_exact`, for unions
    within :data:`SEARCH_STEPS`) beats them, by that partition; False when none does (or the pricing budget is
    spent)."""
    for count in (2, 3):
        for chosen in itertools.combinations(range(len(passes)), count):
            union = sorted(i for k in chosen for i in passes[k])
            if len(priced.cache) >= IMPROVE_EVALUATIONS or _search_steps(len(union), pack_size) > SEARCH_STEPS:
                continue
            before = sum(priced(passes[k]) for k in chosen)
            seconds, better = _exact(union, pack_size, priced)
            if seconds < before - _MARGIN * max(before, 1.0):
                passes[:] = [p for k, p in enumerate(passes) if k not in chosen] + better
                return True
    return False


def optimal_packs(loads: Sequence[PackLoad], pack_size: int, model: PackCostModel) -> tuple[float, list[list[str]]]:
    """The least round seconds over every partition of the tenants into passes of at most ``pack_size``
    (enumerated one by one: small cases only), and one partition that reaches it."""
    best: tuple[float, list[list[str]]] = (math.inf, [])
    priced: dict[tuple[int, ...], float] = {}  # each block priced once: the same pass in many partitions

    def price(members: list[int]) -> float:
        key = tuple(members)
        if key not in priced:
            priced[key] = model.pass_seconds([loads[i] for i in members])
        return priced[key]

    for passes in _partitions(list(range(len(loads))), pack_size):
        seconds = sum(price(members) for members in passes)
        if seconds < best[0]:
            best = (seconds, [[loads[i].name for i in members] for members in passes])
    return best


def _partitions(items: list[int], pack_size: int):
    """Every partition of ``items`` into blocks of at most ``pack_size`` (blocks in the items' order)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for size in range(min(pack_size, len(items))):
        for others in itertools.combinations(rest, size):
            left = [x for x in rest if x not in others]
            for tail in _partitions(left, pack_size):
                yield [[first, *others], *tail]
