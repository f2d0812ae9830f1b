"""Tests of ``kernels.layers.logprob_ops`` (the trainer's LM-head loss op ``chosen_logprobs_``): the Triton kernel
(CUDA when there is a GPU, else the Triton interpreter on the CPU) and the torch path against a float64
log-softmax, over several vocabulary chunks, with and without the logits' gradient written over them."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import chosen_logprobs_

from tests.support.layer_checks import DEVICE
from tests.support.markers import triton_runs

pytestmark = triton_runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chosen_logprobs_and_their_logit_gradients_match_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 9000  # three of the kernel's 4096-column chunks, the last one partial
    logits = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (6,), generator=gen)
    targets[0], targets[1] = vocab - 1, 0
    exact = torch.log_softmax(logits.double(), dim=-1)
    exact_grad = torch.nn.functional.one_hot(targets, vocab).double() - exact.exp()
    for backend in ("torch", "triton"):
        untouched = logits.clone().to(DEVICE)
        plain = chosen_logprobs_(untouched, targets.to(DEVICE), write_grad=False, backend=backend)
        grads = logits.clone().to(DEVICE)
        out = chosen_logprobs_(grads, targets.to(DEVICE), write_grad=True, backend=backend)
        assert torch.equal(untouched.cpu(), logits)
        assert out.dtype == torch.float32 and out.std() > 0.5
        torch.testing.assert_close(plain, out)
        torch.testing.assert_close(out.cpu().double(), exact.gather(1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-5)
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
        torch.testing.assert_close(grads.cpu().double(), exact_grad.to(dtype).double(), **tolerance)
