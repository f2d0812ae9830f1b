"""What a request to the sampling engine asks for and what it gets back, how its RNG seed is derived, and the
items the scheduler queues and plans: requests, publishes, unregisters and a prefill pass's plan."""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from dataclasses import dataclass, field

from skyrl_clora.lora.layers import AdapterWeights


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. ``temperature == 0`` is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass
class Completion:
    """What one request produced: ``token_ids`` (including a final stop token), the log-probability of
    each under the distribution it was drawn from (``logits / temperature``; greedy: untempered),
    ``finish_reason`` ("stop" or "length") and the version of the adapter the whole completion was sampled with
    (``-1`` for the base model)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    adapter_version: int


def derive_seed(seed: int, session: str, prompt_len: int) -> int:
    """A request's 63-bit RNG seed from (run seed, session id, prompt length): the same request of the same
    episode turn gets the same seed whatever else runs beside it. No adapter name enters it: a tenant's
    sessions are named after its seed (``episodes.episode_batch``), so that renaming a tenant changes nothing."""
    key = f"{seed}|{session}|{prompt_len}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


@dataclass
class QueuedRequest:
    """One generation request, from submission until its future resolves. :meth:`Scheduler.admit` sets its cache
    ``row``, the adapter ``version`` it is sampled with and the finished turn its prompt extends (``history``:
    ``(length, blocks)`` from :meth:`BlockManager.take_history`, whose references the request holds until its
    row adopts them) and its adapter's ``lora_slot``; the engine sets ``admitted`` (``time.perf_counter()``) at
    each prefill and ``output`` / ``logprobs`` when it finishes: ``admitted - submitted`` is its queue wait."""

    prompt_ids: list[int]
    adapter: str | None
    params: SamplingParams
    future: concurrent.futures.Future
    row: int = -1
    lora_slot: int = -1
    version: int = -1
    history: tuple[int, list[int]] | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    queued_at: int = 0  # the scheduler's decode-step count when the request was queued
    resumes: bool = False  # it waits ahead of fresh requests: it extends a kept history, or was preempted
    submitted: float = field(default_factory=time.perf_counter)  # when it was made (the start of its queue wait)
    admitted: float = 0.0


@dataclass
class Publish:
    """``weights`` (host memory: ``AdapterSlots.host_copy``) as ``adapter``'s ``version``, written into its device slot
    in place if it holds one; ``future`` resolves once applied."""

    adapter: str
    weights: AdapterWeights
    version: int
    future: concurrent.futures.Future


@dataclass
class Unregister:
    """The removal of ``adapter`` (its host copy dropped, its slot freed, its waiting requests failed); ``future``
    resolves then."""

    adapter: str
    future: concurrent.futures.Future


@dataclass
class PrefillPlan:
    """The requests to prefill in one pass, in admission order, each holding its row and the blocks of its
    prompt; ``starts[i]``: the first position the pass computes for ``requests[i]`` (the positions before it are
    in blocks its row adopted); ``copies``: ``(sources, targets)``, the shared blocks whose K/V the engine copies
    before the pass (a row's own copy of a block it writes into); ``loads``: the adapters given a device slot for
    these requests, whose host copies the engine writes into their slots before the pass (:meth:`AdapterSlots.load`),
    ``evictions`` of them in a slot taken from another adapter; ``hits``: the requests whose adapter held its slot
    already."""

    requests: list[QueuedRequest] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    copies: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    loads: list[str] = field(default_factory=list)
    evictions: int = 0
    hits: int = 0
