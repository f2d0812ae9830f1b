"""Vectorised token sampling for a whole engine step, with a counter-based RNG per request.

Every row of a step is sampled at once on the logits' device (one host synchronisation per step, when the
caller reads the tokens back). Randomness comes from one uniform number per row, hashed on the host from
(request seed, index of the token in the completion): a request's draws do not depend on which other rows
share its batch, on the device, or on how many steps ran before it (reproducible under any mix of tenants).

Sampling is inverse-CDF: with ``p = softmax(logits / temperature)`` and ``u`` the row's uniform number, the
token is the first index whose cumulative probability exceeds ``u * sum(p)`` (never a token of probability 0).
The cumulative sums run in two levels, over blocks of :data:`CDF_BLOCK` tokens and then inside the chosen
block: a scan over the whole vocabulary was the slowest kernel of a GPU decode step. Top-p keeps the
smallest set of most likely tokens whose mass reaches ``top_p`` and renormalises. ``temperature == 0`` is
greedy (argmax). The returned log-probability is under the untempered distribution (what the trainer
recomputes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyrl_clora.device_copy import lists_to_device

_MASK64 = (1 << 64) - 1
CDF_BLOCK = 1024  # tokens per block of the two-level inverse CDF


def _splitmix64(value: int) -> int:
    """One round of the SplitMix64 generator's output function (a bijective 64-bit mix)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def request_uniform(seed: int, index: int) -> float:
    """The uniform number in ``(0, 1)`` for token ``index`` of the request seeded ``seed``."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 11  # 53 random bits
    return (bits + 0.5) / float(1 << 53)


@dataclass(frozen=True)
class RowSampling:
    """Sampling settings and RNG draw of one row: ``temperature`` (0 = greedy), ``top_p`` and ``uniform``
    (from :func:`request_uniform`)."""

    temperature: float
    top_p: float
    uniform: float


def sample_rows(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[list[int], list[float]]:
    """Samples one token for each row of ``logits: [N, V]`` (any float dtype; computed in fp32) with the
    settings ``rows[i]`` (``len(rows) == N``). Returns the tokens and their untempered log-probabilities."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} sampling settings")
    logits = logits.float()
    device = logits.device
    temperature, uniform = lists_to_device([[r.temperature for r in rows], [r.uniform for r in rows]], device, torch.float32)
    greedy = temperature == 0.0
    temperature = temperature.clamp(min=1e-6)
    log_normaliser = torch.logsumexp(logits, dim=-1)  # [N]

    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    nucleus = [i for i, r in enumerate(rows) if r.top_p < 1.0 and r.temperature > 0.0]
    sampled = _inverse_cdf(probs, uniform)
    if nucleus:
        index = lists_to_device([nucleus], device)[0]
        top_p = lists_to_device([[rows[i].top_p for i in nucleus]], device, torch.float32)[0]
        sampled[index] = _inverse_cdf_top_p(probs[index], uniform[index], top_p)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    chosen = logits.gather(1, tokens[:, None])[:, 0] - log_normaliser
    pair = torch.stack([tokens.double(), chosen.double()]).cpu()  # the step's one host synchronisation
    return [int(t) for t in pair[0].tolist()], pair[1].tolist()


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` probabilities (each row with positive mass), ``[N]`` uniforms -> ``[N]`` token ids (int64):
    the first index whose cumulative probability exceeds ``u * sum(p)``, found block by block; where
    rounding puts the target past a row's mass, the last token of positive probability."""
    num, vocab = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -vocab % CDF_BLOCK)).view(num, -1, CDF_BLOCK)  # [N, nb, B]
    block_mass = blocks.sum(-1)  # [N, nb]
    block_cdf = block_mass.cumsum(-1)
    target = uniform * block_cdf[:, -1]  # [N]
    block_ids = torch.arange(block_mass.shape[1], device=probs.device)
    last_block = torch.where(block_mass > 0, block_ids, 0).amax(-1, keepdim=True)  # [N, 1]
    block = torch.searchsorted(block_cdf, target[:, None], right=True).clamp(max=last_block)  # [N, 1]
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK))[:, 0]  # [N, B]
    before = (block_cdf.gather(1, block) - block_mass.gather(1, block))[:, 0]  # mass ahead of the block
    offset = torch.searchsorted(inside.cumsum(-1), (target - before)[:, None], right=True)  # [N, 1]
    token_ids = torch.arange(CDF_BLOCK, device=probs.device)
    last_token = torch.where(inside > 0, token_ids, 0).amax(-1, keepdim=True)
    return (block * CDF_BLOCK + offset.clamp(max=last_token))[:, 0]


def _inverse_cdf_top_p(probs: torch.Tensor, uniform: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling restricted to each row's nucleus (most likely tokens up to mass ``top_p``)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p[:, None]
    picked = _inverse_cdf(sorted_probs * keep, uniform)
    return order.gather(1, picked[:, None])[:, 0]
