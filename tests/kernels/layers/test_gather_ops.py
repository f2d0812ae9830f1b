"""Tests of ``kernels.layers.gather_ops`` (``gather_rows``' atomics-free backward): ``inverse_index`` lists each
source row's gathering positions in order and refuses an index past the rows, and the Triton segmented sum (CUDA
when there is a GPU, else the Triton interpreter on the CPU) gives ``index_select``'s gradient under autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_clora.kernels import gather_rows
from skyrl_clora.kernels.layers.gather_ops import inverse_index

from tests.support.layer_checks import DEVICE
from tests.support.layer_checks import forward_backward as _forward_backward
from tests.support.markers import triton_runs


@triton_runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_backward_sums_each_rows_gradients_like_index_select(dtype: torch.dtype) -> None:
    """Rows gathered 0, 1 or several times (as prompt keys are, once per row of their group), from a strided
    ``[N, KV, d]`` view (the trainer's transposed keys), with a width past one program's block."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(3, 40, 352, generator=gen).to(DEVICE, dtype)  # [KV, N, d]; rows of 3 * 352 > 1024 columns
    index_np = np.concatenate([np.arange(0, 40, 2), np.repeat(np.arange(5, 12), 4), [39, 0, 39]])
    index = torch.from_numpy(index_np).to(DEVICE)
    starts, sources = (torch.from_numpy(a).to(DEVICE) for a in inverse_index(index_np, 40))
    dy = torch.randn(len(index_np), 3, 352, generator=gen).to(DEVICE, dtype)
    def gather(backend: str):
        return lambda x: gather_rows(x.transpose(0, 1), index, starts, sources, backend=backend)

    got_y, (got_dx,) = _forward_backward(gather("triton"), [base], dy)
    want_y, (want_dx,) = _forward_backward(gather("torch"), [base], dy)
    assert (want_dx[:, 1::2].abs().sum(dim=(0, 2)) > 0).sum() >= 4  # some odd rows gathered ...
    assert want_dx[:, 13].abs().sum() == 0  # ... and some never: their gradient is zero
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got_dx, want_dx, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="past the 40 rows"):
        inverse_index(np.array([0, 40]), 40)


def test_inverse_index_lists_each_rows_positions_in_order() -> None:
    starts, sources = inverse_index(np.array([2, 0, 2, 3, 2]), 5)
    assert starts.tolist() == [0, 1, 1, 4, 5, 5]  # row 0 gathered once, row 1 never, row 2 three times, ...
    assert sources.tolist() == [1, 0, 2, 4, 3]
    for row in range(5):
        assert sources[starts[row] : starts[row + 1]].tolist() == [j for j, t in enumerate([2, 0, 2, 3, 2]) if t == row]
    with pytest.raises(ValueError, match="index holds 5, past the 5 rows"):
        inverse_index(np.array([0, 5]), 5)
