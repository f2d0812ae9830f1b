"""Vectorised sampling with counter-based per-request RNG (skyrl_clora.sampler.sampling)."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels.reference import CDF_BLOCK, inverse_cdf_ref
from skyrl_clora.sampler.sampling import request_uniforms, sample_rows


def test_request_uniforms_are_a_deterministic_stream_in_the_open_interval() -> None:
    draws = request_uniforms([7] * 2000, range(2000)).tolist()
    assert draws == request_uniforms([7] * 2000, range(2000)).tolist()
    assert all(0.0 < u < 1.0 for u in draws)
    assert draws != request_uniforms([8] * 2000, range(2000)).tolist()
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert len(set(draws)) == len(draws)


def test_request_uniforms_are_splitmix64_of_seed_and_index() -> None:
    """The vectorised draws equal SplitMix64 written with Python integers, for seeds over the whole 64 bits."""
    mask = (1 << 64) - 1

    def mix(value: int) -> int:
        value = (value + 0x9E3779B97F4A7C15) & mask
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
        return value ^ (value >> 31)

    seeds = [0, 1, 7, (1 << 63) - 1, (1 << 64) - 1, 0x0123456789ABCDEF, -5]
    indices = [0, 1, 2, 5000, 3, 99, 4]
    want = [((mix(mix(seed & mask) ^ index) >> 11) + 0.5) / float(1 << 53) for seed, index in zip(seeds, indices)]
    assert request_uniforms(seeds, indices).tolist() == want


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    temperature = 0.7
    probs = torch.softmax(logits[0] / temperature, dim=0)
    counts = torch.zeros(5)
    draws = 4000
    for index in range(draws):
        tokens, _ = sample_rows(logits, [temperature], [1.0], request_uniforms([3], [index]))
        counts[tokens[0]] += 1
    assert counts[4] == 0
    assert torch.allclose(counts / draws, probs, atol=0.025)


def test_a_row_samples_the_same_alone_and_in_any_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 300, generator=generator) * 3
    temperature = [[0.0, 1.0, 0.6][i % 3] for i in range(37)]
    top_p = [[1.0, 0.9][i % 2] for i in range(37)]
    uniform = request_uniforms(range(37), [5] * 37)
    batch_tokens, batch_logprobs = sample_rows(logits, temperature, top_p, uniform)
    alone = [sample_rows(logits[i : i + 1], temperature[i : i + 1], top_p[i : i + 1], uniform[i : i + 1]) for i in range(37)]
    assert batch_tokens == [tokens[0] for tokens, _ in alone]
    assert batch_logprobs == [logprobs[0] for _, logprobs in alone]
    assert len(set(batch_tokens)) > 10, "rows must not all draw the same token"


def test_greedy_top_p_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [1.0, 0.5, 0.0, 4.0]])
    untempered = torch.log_softmax(logits, dim=-1)
    tokens, logprobs = sample_rows(logits, [0.0, 0.0], [1.0, 1.0], [0.99, 0.01])
    assert tokens == [1, 3]
    assert logprobs == pytest.approx([float(untempered[0, 1]), float(untempered[1, 3])], abs=1e-6)
    # top_p = 0.5 keeps only token 1 of row 0 (its probability is ~0.5 before token 2 joins).
    nucleus = {sample_rows(logits[:1], [1.0], [0.5], request_uniforms([1], [i]))[0][0] for i in range(200)}
    assert nucleus == {1}
    wide = {sample_rows(logits[:1], [1.0], [1.0], request_uniforms([1], [i]))[0][0] for i in range(200)}
    assert {1, 2} <= wide


def test_mismatched_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="2 rows of logits but 1 temperatures"):
        sample_rows(torch.zeros(2, 4), [1.0], [1.0, 1.0], [0.5, 0.5])


def test_two_level_inverse_cdf_picks_the_exact_token() -> None:
    """Against a float64 scan of the whole row: the same token wherever rounding cannot decide (the target
    farther than 1e-5 of the row's mass from a cumulative sum), and never a token of probability 0."""
    generator = torch.Generator().manual_seed(0)
    vocab = 3 * CDF_BLOCK + 77  # a partial last block
    probs = torch.softmax(torch.randn(400, vocab, generator=generator) * 4, dim=-1)
    probs[torch.rand(400, vocab, generator=generator) < 0.3] = 0.0  # zeros, as top-p leaves them
    probs[:50, CDF_BLOCK:] = 0.0  # rows whose mass sits in the first block only
    uniform = torch.rand(400, generator=generator)
    uniform[:5] = 1.0  # rounding puts the target at the row's total
    got = inverse_cdf_ref(probs, uniform)
    cdf = probs.double().cumsum(-1)
    target = uniform.double() * cdf[:, -1]
    want = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    clear = ((cdf - target[:, None]).abs() > 1e-5 * cdf[:, -1:]).all(-1)
    assert int(clear.sum()) > 300 and torch.equal(got[clear], want[clear])
    assert bool((probs.gather(1, got[:, None]) > 0).all()), "a token of probability 0 was drawn"
    last_positive = torch.where(probs > 0, torch.arange(vocab), 0).amax(-1)
    assert torch.equal(got[:5], last_positive[:5])
