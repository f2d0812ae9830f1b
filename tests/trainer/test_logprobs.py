"""Chosen-token log-probs (:mod:`skyrl_clora.trainer.logprobs`): the chunked LM-head log-probs equal
``log_softmax`` of the full logits (at a per-row temperature too) with the same gradients, need a frozen head, and the
training temperature is SkyRL's but for greedy or unset temperatures, which score the untempered distribution."""

from __future__ import annotations

import pytest
import torch
from skyrl.train.config import AlgorithmConfig

from skyrl_clora.sampler.sampling import sample_rows
from skyrl_clora.trainer.logprobs import token_logprobs, training_temperature


def test_chunked_token_logprobs_match_log_softmax() -> None:
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True).requires_grad_(False)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=generator)
    weights = torch.randn(37, generator=generator)
    got = token_logprobs(hidden, head, targets, max_logits=50 * 8)  # chunks of 8 rows
    (got * weights).sum().backward()
    grad, hidden.grad = hidden.grad.clone(), None
    expected = torch.log_softmax(head(hidden), dim=-1).gather(-1, targets[:, None])[:, 0]
    (expected * weights).sum().backward()
    assert got.std() > 0.1
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad, hidden.grad)
    head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen LM head"):
        token_logprobs(hidden, head, targets)


def test_chunked_token_logprobs_at_a_temperature_and_their_gradients() -> None:
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True).requires_grad_(False)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=generator)
    temperature = torch.rand(37, generator=generator) + 0.3
    weights = torch.randn(37, generator=generator)
    got = token_logprobs(hidden, head, targets, max_logits=50 * 8, temperature=temperature)  # chunks of 8 rows
    (got * weights).sum().backward()
    grad, hidden.grad = hidden.grad.clone(), None
    expected = torch.log_softmax(head(hidden) / temperature[:, None], dim=-1).gather(-1, targets[:, None])[:, 0]
    (expected * weights).sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad, hidden.grad)


def test_greedy_and_unset_temperatures_score_the_untempered_distribution() -> None:
    """SkyRL divides by the temperature, which has no meaning at 0 (greedy): the rule is the untempered logits,
    the ones the sampler reports greedy tokens' log-probs under."""
    assert training_temperature(AlgorithmConfig(temperature=0.0)) == 1.0
    assert training_temperature(AlgorithmConfig(temperature=None)) == 1.0
    assert training_temperature(AlgorithmConfig(temperature=0.7)) == 0.7
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [1.0, 0.5, 0.0, 4.0], [0.2, 0.1, -0.3, 0.0]])
    tokens, logprobs = sample_rows(logits, [0.0, 0.5, 2.0], [1.0, 1.0, 0.9], [0.4, 0.3, 0.6])
    for row, (temperature, token) in enumerate(zip([1.0, 0.5, 2.0], tokens)):
        assert logprobs[row] == pytest.approx(float(torch.log_softmax(logits[row] / temperature, -1)[token]), abs=1e-6)
