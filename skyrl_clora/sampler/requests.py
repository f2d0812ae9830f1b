"""What a request to the sampling engine asks for and what it gets back, and how its RNG seed is derived."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


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
