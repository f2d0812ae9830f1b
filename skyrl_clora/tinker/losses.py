"""Tinker's per-token losses in torch, as SkyRL's Tinker server names and computes them (``skyrl.tinker.loss_fns``).

Each loss of a datum of ``N`` positions is elementwise ``[N]``: ``weights`` (Tinker's ``weights``, 1 where the client
sent none) mask the positions, ``logprobs`` are the trained policy's log-probs of the target tokens,
``sampling_logprobs`` the sampler's (Tinker's ``logprobs`` input) and ``advantages`` Tinker's ``advantages``:

- ``cross_entropy``: ``-w * lp``;
- ``importance_sampling``: ``-w * exp(lp - lp_sampling) * A``;
- ``ppo``: ``-w * min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)`` with ``r = exp(lp - lp_sampling)``
  (thresholds 0.8 and 1.2 unless ``loss_fn_config`` gives them);
- ``cispo``: ``-w * stopgrad(clip(r, low, high)) * lp * A``.

A request's loss is the sum over its datums' positions (Tinker's convention: no normalisation), so gradients of
several ``forward_backward`` calls before one ``optim_step`` add up as one call over all their datums would.
"""

from __future__ import annotations

import torch

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
NEEDS_SAMPLING = {"importance_sampling", "ppo", "cispo"}  # the losses that read sampling log-probs and advantages
DEFAULT_CLIP = (0.8, 1.2)


def elementwise_loss(loss_fn: str, logprobs: torch.Tensor, weights: torch.Tensor,
                     sampling_logprobs: torch.Tensor | None, advantages: torch.Tensor | None,
                     config: dict[str, float] | None) -> torch.Tensor:
    """The ``[N]`` loss of one datum (module docstring); ``logprobs`` carries the gradient. A ValueError names a loss
    this module lacks or an input the loss needs and the datum does not carry."""
    if loss_fn not in LOSSES:
        raise ValueError(f"loss_fn {loss_fn!r} is not supported by the clora backend; use one of {', '.join(LOSSES)}")
    if loss_fn == "cross_entropy":
        return -(weights * logprobs)
    if sampling_logprobs is None or advantages is None:
        raise ValueError(f"loss_fn {loss_fn!r} needs the datum's logprobs (the sampler's) and advantages")
    ratio = torch.exp(logprobs - sampling_logprobs)
    if loss_fn == "importance_sampling":
        return -(weights * ratio * advantages)
    low, high = _clip(config)
    clipped = ratio.clamp(low, high)
    if loss_fn == "ppo":
        return -(weights * torch.minimum(ratio * advantages, clipped * advantages))
    return -(weights * clipped.detach() * logprobs * advantages)


def _clip(config: dict[str, float] | None) -> tuple[float, float]:
    config = config or {}
    return (float(config.get("clip_low_threshold", DEFAULT_CLIP[0])),
            float(config.get("clip_high_threshold", DEFAULT_CLIP[1])))
