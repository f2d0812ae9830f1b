"""Named ranges for ``torch.profiler``: each call of a decorated function is one range (what
``scripts/bench_e2e.py --profile`` reports per phase of the engine and the trainer)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from torch.profiler import record_function

F = TypeVar("F", bound=Callable)


def profiled(name: str) -> Callable[[F], F]:
    """Decorator: runs the function inside ``record_function(name)``, a new range per call (so calls from
    several threads, e.g. two engines, never share one)."""
    def decorate(function: F) -> F:
        @functools.wraps(function)
        def ranged(*args, **kwargs):
            with record_function(name):
                return function(*args, **kwargs)
        return ranged  # type: ignore[return-value]
    return decorate
