"""The end-to-end benchmark's per-turn generation lengths (``--lengths``): a fixed length, or a lognormal clipped
to a cap (long-tailed, like real RL rollouts), drawn by a counter-based RNG so that a turn's length depends only
on (tenant seed, step, episode index, turn), never on the order in which episodes run: serial and concurrent
runs of the same tenants sample exactly the same lengths.

Specs (:func:`parse_lengths`):

- ``fixed:N``: every turn samples N tokens (N >= 1);
- ``lognormal:median=M,sigma=S,cap=C``: ``round(M * exp(S * z))`` with z ~ N(0, 1), clipped to [1, C]
  (M > 0, S >= 0, C >= 1 an integer; the median is M while M <= C);
- presets: ``longtail`` = ``lognormal:median=128,sigma=1.0,cap=512``,
  ``hard`` = ``lognormal:median=300,sigma=0.9,cap=1024``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

PRESETS = {
    "longtail": "lognormal:median=128,sigma=1.0,cap=512",
    "hard": "lognormal:median=300,sigma=0.9,cap=1024",
}
ACCEPTED = ("fixed:N (N >= 1), lognormal:median=M,sigma=S,cap=C (M > 0, S >= 0, integer C >= 1), "
            + ", ".join(f"{name} (= {spec})" for name, spec in PRESETS.items()))
_STREAM = 0x6C656E73  # "lens": keeps these draws apart from any other stream seeded from the same counters


@dataclass(frozen=True)
class Lengths:
    """A per-turn ``max_tokens`` distribution: ``kind`` "fixed" (every draw ``cap``) or "lognormal" (median
    ``median``, log-space standard deviation ``sigma``, clipped to [1, ``cap``]). ``spec`` is its canonical
    ``--lengths`` text."""

    kind: str
    cap: int
    median: float = 0.0
    sigma: float = 0.0

    @property
    def spec(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.cap}"
        return f"lognormal:median={self.median:g},sigma={self.sigma:g},cap={self.cap}"

    def draw(self, seed: int, step: int, episode: int, turn: int) -> int:
        """The length of turn ``turn`` of episode ``episode`` of step ``step`` of the tenant seeded ``seed``
        (all >= 0): a pure function of those four numbers, in [1, cap]."""
        if self.kind == "fixed":
            return self.cap
        z = counter_rng(seed, step, episode, turn).standard_normal()
        return int(min(max(round(self.median * math.exp(self.sigma * z)), 1), self.cap))


def counter_rng(*counters: int) -> np.random.Generator:
    """A generator keyed on non-negative ``counters`` alone (numpy's SeedSequence hashes the tuple): the same
    counters give the same stream in any order of calls, and neighbouring counters give unrelated streams."""
    return np.random.default_rng([_STREAM, *counters])


def distinct_prompt_tokens(groups: int, samples: int, prompt: int, turns: int, observation: int) -> int:
    """The prompt positions no earlier pass computed over ``groups`` GRPO groups of ``samples`` episodes: each
    group's ``prompt``-token prompt once, and for each later turn of an episode its ``observation`` tokens and the
    previous turn's last sampled token (the others' K/V a decode step computed). An engine that recomputes nothing
    prefills exactly these."""
    return groups * (prompt + samples * (turns - 1) * (observation + 1))


def parse_lengths(spec: str) -> Lengths:
    """The :class:`Lengths` of a ``--lengths`` spec; raises a one-line ValueError naming the accepted forms."""
    text = PRESETS.get(spec.strip(), spec.strip())
    kind, _, body = text.partition(":")
    try:
        if kind == "fixed":
            length = int(body)
            if length >= 1:
                return Lengths("fixed", length)
        elif kind == "lognormal":
            fields = dict(item.split("=", 1) for item in body.split(","))
            if set(fields) == {"median", "sigma", "cap"}:
                median, sigma, cap = float(fields["median"]), float(fields["sigma"]), int(fields["cap"])
                if median > 0 and sigma >= 0 and cap >= 1 and math.isfinite(median) and math.isfinite(sigma):
                    return Lengths("lognormal", cap, median, sigma)
    except ValueError:
        pass
    raise ValueError(f"--lengths {spec!r} is not understood; use {ACCEPTED}")


def length_summary(lengths: Iterable[int]) -> dict[str, float]:
    """``count``, ``mean``, ``p50``, ``p90`` and ``max`` of per-turn lengths (nearest-rank percentiles;
    zeros when there are none)."""
    values = sorted(lengths)
    if not values:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}

    def rank(q: float) -> float:
        return float(values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))])

    return {"count": len(values), "mean": sum(values) / len(values), "p50": rank(0.5), "p90": rank(0.9),
            "max": float(values[-1])}
