"""Helpers shared by the tests of the fused layer ops and the sampler (tests/kernels/layers/, and
tests/kernels/test_reference.py): the device their Triton kernels run on (CUDA when there is a GPU, else the CPU
through the Triton interpreter), a forward and backward pass of an op, and the sampling tests' vocabulary size."""

from __future__ import annotations

from collections.abc import Callable

import torch

from skyrl_clora.kernels.reference import CDF_BLOCK

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SAMPLING_VOCAB = 3 * CDF_BLOCK - 72  # a partial last CDF block and a partial last chunk


def forward_backward(op: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
                     dy: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``op`` on fresh leaf copies of ``inputs``, backpropagated from ``dy``: ``(y, [d input for each input])``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    y = op(*leaves)
    y.backward(dy)
    return y.detach(), [leaf.grad for leaf in leaves]
