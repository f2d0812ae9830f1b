"""Named profiler ranges (:mod:`skyrl_clora.device.profiling`): a ``profiled`` function keeps its name, arguments and
result, and each of its calls is one range of that name in a ``torch.profiler`` trace."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from skyrl_clora.device.profiling import profiled


@profiled("clora.test_range")
def _scaled(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    """Multiplies ``x`` by ``factor``."""
    return x * factor


def test_a_profiled_function_is_the_function() -> None:
    assert _scaled.__name__ == "_scaled" and _scaled.__doc__ == "Multiplies ``x`` by ``factor``."
    assert torch.equal(_scaled(torch.ones(3), factor=3.0), torch.full((3,), 3.0))


def test_each_call_is_one_range_of_its_name() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        for _ in range(3):
            _scaled(torch.ones(4))
    names = [event.name for event in trace.events()]
    assert names.count("clora.test_range") == 3
