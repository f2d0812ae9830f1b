"""Tinker's losses (skyrl_clora.tinker.losses) against their formulas written out on random inputs: values and the
gradient in the policy's log-probs, the clip thresholds of ppo and cispo, and the errors for a loss this backend
lacks or an input a loss needs."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.tinker.losses import DEFAULT_CLIP, LOSSES, elementwise_loss


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(12, generator=generator) * 3
    sampling = logprobs + 0.4 * torch.randn(12, generator=generator)  # ratios on both sides of the clip range
    advantages = torch.randn(12, generator=generator)
    weights = (torch.rand(12, generator=generator) > 0.3).float()
    return logprobs.requires_grad_(), sampling, advantages, weights


def _reference(loss_fn: str, lp: torch.Tensor, lp_s: torch.Tensor, adv: torch.Tensor, w: torch.Tensor,
               low: float, high: float) -> torch.Tensor:
    ratio = torch.exp(lp - lp_s)
    if loss_fn == "cross_entropy":
        return -w * lp
    if loss_fn == "importance_sampling":
        return -w * ratio * adv
    if loss_fn == "ppo":
        return -w * torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
    return -w * torch.clamp(ratio, low, high).detach() * lp * adv


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("config", [None, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}])
def test_each_loss_and_its_gradient_are_the_formulas(loss_fn: str, config: dict | None) -> None:
    lp, lp_s, adv, w = _inputs(seed=len(loss_fn))
    low, high = (config["clip_low_threshold"], config["clip_high_threshold"]) if config else DEFAULT_CLIP
    got = elementwise_loss(loss_fn, lp, w, lp_s, adv, config)
    (grad,) = torch.autograd.grad(got.sum(), lp)
    expected = _reference(loss_fn, lp, lp_s, adv, w, low, high)
    (expected_grad,) = torch.autograd.grad(expected.sum(), lp)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert torch.all(got[w == 0] == 0)  # masked positions add nothing


def test_the_clip_thresholds_change_ppo_where_a_ratio_leaves_them() -> None:
    lp, lp_s, adv, w = _inputs(seed=1)
    ratio = torch.exp(lp - lp_s).detach()
    assert bool(((ratio < 0.8) | (ratio > 1.2)).any())  # the inputs reach past the default clip range
    wide = elementwise_loss("ppo", lp, w, lp_s, adv, {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0})
    torch.testing.assert_close(wide, elementwise_loss("importance_sampling", lp, w, lp_s, adv, None))
    assert not torch.equal(elementwise_loss("ppo", lp, w, lp_s, adv, None), wide)


def test_a_loss_this_backend_lacks_and_a_missing_input_are_named() -> None:
    lp, lp_s, adv, w = _inputs(seed=2)
    with pytest.raises(ValueError, match="^loss_fn 'dppo' is not supported by the clora backend; use one of"):
        elementwise_loss("dppo", lp, w, lp_s, adv, None)
    with pytest.raises(ValueError, match="^loss_fn 'importance_sampling' needs the datum's logprobs"):
        elementwise_loss("importance_sampling", lp, w, None, adv, None)
    assert torch.equal(elementwise_loss("cross_entropy", lp, w, None, None, None), -(w * lp))
