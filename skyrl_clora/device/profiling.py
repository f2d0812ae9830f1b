"""Named ranges for ``torch.profiler``: each call of a decorated function is one range (the trainer's
forward and backward in ``python -m benchmarks.train --profile``; the profiler records ranges on the thread that
started it only, so the engine's and the services' trainer threads show kernels but no ranges)."""

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
