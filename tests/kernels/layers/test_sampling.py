"""Tests of ``kernels.layers.sampling`` (token sampling in one launch): the Triton kernel (through the Triton
interpreter, ``TRITON_INTERPRET=1``, set by scripts/test.sh) against the torch reference and a float64 check of the
semantics, at small sizes: chunked and single-chunk rows, greedy ties, a target at the row's total, rows independent
of the batch, draws following the tempered distribution, and the shape checks; tests/gpu/test_sampling_gpu.py
repeats them at real sizes."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import sample_tokens
from skyrl_clora.kernels.reference import sample_tokens_ref
from skyrl_clora.kernels.layers.sampling import sample_tokens_triton
from tests.support.kernel_cases import check_samples, make_sampling_problem
from tests.support.layer_checks import SAMPLING_VOCAB as VOCAB
from tests.support.markers import interpreted


@interpreted
@pytest.mark.parametrize("block_v", [256, 1024, None], ids=["chunks256", "chunks1024", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_reference(dtype: torch.dtype, block_v: int | None) -> None:
    """Several chunks per row (crossing the reference's CDF blocks) and one chunk (the default ``block_v``);
    the same tokens as the reference wherever rounding cannot decide, greedy ties at the first maximum, the
    last token of positive probability for a target at the row's total."""
    p = make_sampling_problem(7, VOCAB, dtype, seed=0)
    if block_v is None:
        tokens, logprobs = sample_tokens(p.logits, p.temperature, p.uniform, backend="triton")
    else:
        tokens, logprobs = sample_tokens_triton(p.logits, p.temperature, p.uniform, block_v=block_v)
    want_tokens, want_logprobs = sample_tokens_ref(p.logits, p.temperature, p.uniform)
    assert len(set(want_tokens.tolist())) == 7, "rows must draw different tokens"
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and tokens.shape == logprobs.shape == (7,)
    clear = check_samples(p, tokens, logprobs)
    assert int(clear.sum()) >= 3 and torch.equal(tokens[clear], want_tokens[clear])
    assert int(tokens[2]) == VOCAB // 3 - 1, "greedy ties go to the first maximum"
    last_positive = int(torch.isfinite(p.logits[3]).nonzero().max())
    assert int(tokens[3]) == last_positive, "u = 1 draws the last token of positive probability"
    same = tokens == want_tokens
    assert torch.allclose(logprobs[same], want_logprobs[same], rtol=0.0, atol=1e-5)


@interpreted
def test_triton_rows_are_independent_of_the_batch() -> None:
    """A row draws the same token and log-probability alone and in a batch, bit for bit."""
    p = make_sampling_problem(5, 600, seed=3)
    tokens, logprobs = sample_tokens_triton(p.logits, p.temperature, p.uniform, block_v=128)
    for row in range(5):
        alone = sample_tokens_triton(p.logits[row:row + 1], p.temperature[row:row + 1], p.uniform[row:row + 1], block_v=128)
        assert int(alone[0][0]) == int(tokens[row]) and float(alone[1][0]) == float(logprobs[row])


@interpreted
def test_triton_draws_follow_the_tempered_distribution() -> None:
    """Draws of one row at evenly spaced uniforms (one launch: the row repeated) follow ``softmax(l / T)``
    within one draw."""
    draws = 200
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0, float("-inf")]).repeat(draws, 1)
    uniform = (torch.arange(draws) + 0.5) / draws
    tokens, _ = sample_tokens(logits, torch.full((draws,), 0.7), uniform, backend="triton")
    counts = torch.bincount(tokens, minlength=6).double() / draws
    assert counts[4] == counts[5] == 0
    assert torch.allclose(counts, torch.softmax(logits[0].double() / 0.7, 0), atol=1.0 / draws)


@interpreted
def test_triton_rejects_bad_shapes() -> None:
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="shape"):
        sample_tokens(logits, torch.zeros(3), torch.zeros(2), backend="triton")
    with pytest.raises(ValueError, match="power of two"):
        sample_tokens_triton(logits, torch.zeros(2), torch.zeros(2), block_v=48)
