"""Vectorised token sampling for a whole engine step, with a counter-based RNG per request.

Every row of a step is sampled at once on the logits' device (one host synchronisation per step, when the
caller reads the tokens back). Randomness comes from one uniform number per row, hashed on the host from
(request seed, index of the token in the completion): a request's draws do not depend on which other rows
share its batch, on the device, or on how many steps ran before it (reproducible under any mix of tenants).

Sampling is inverse-CDF: with ``p = softmax(logits / temperature)`` and ``u`` the row's uniform number, the
token is the first index whose cumulative probability exceeds ``u * sum(p)`` (never a token of probability 0).
``temperature == 0`` is greedy (argmax). The returned log-probability is the token's under the distribution it
was drawn from, before top-p: ``log_softmax(logits / temperature)`` (what the trainer recomputes, as SkyRL's policy
forward divides by the sampling temperature; vLLM's ``logprobs_mode=processed_logprobs`` less its top-p
renormalisation), untempered for greedy rows. The kernels return untempered log-probs; rows at a temperature
other than 0 and 1 get theirs again from their tempered logits. These rows go through ``kernels.sample_tokens``: on a GPU one Triton launch
for the whole step (``kernels.sampling``), elsewhere the torch reference, whose cumulative sums run in two
levels (blocks of ``kernels.reference.CDF_BLOCK`` tokens, then inside the chosen block). Top-p keeps the smallest set of
most likely tokens whose mass reaches ``top_p`` and renormalises; those rows are drawn by a sort-based torch
path after the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from skyrl_clora.device.staging import lists_to_device
from skyrl_clora.kernels import sample_tokens
from skyrl_clora.kernels.reference import MIN_TEMPERATURE, inverse_cdf_ref

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(value: np.ndarray) -> np.ndarray:
    """One round of the SplitMix64 generator's output function (a bijective 64-bit mix), element-wise on
    ``uint64`` (wrapping arithmetic)."""
    value = value + _GOLDEN
    value = (value ^ (value >> np.uint64(30))) * _MIX1
    value = (value ^ (value >> np.uint64(27))) * _MIX2
    return value ^ (value >> np.uint64(31))


def request_uniforms(seeds: Sequence[int] | np.ndarray, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[N]`` float64 in ``(0, 1)``: the uniform number for token ``indices[i]`` of the request seeded
    ``seeds[i]`` (seeds taken modulo 2**64; a ``uint64`` array as it is), one vectorised pass for a whole step."""
    if isinstance(seeds, np.ndarray) and seeds.dtype == np.uint64:
        seeds_u = seeds
    else:
        seeds_u = np.array([seed & 0xFFFFFFFFFFFFFFFF for seed in seeds], dtype=np.uint64)
    bits = _splitmix64(_splitmix64(seeds_u) ^ np.asarray(indices, dtype=np.uint64)) >> np.uint64(11)  # 53 random bits
    return (bits.astype(np.float64) + 0.5) / float(1 << 53)


class DrawnTokens:
    """One step's sampled tokens: on the device (``tokens: [N]`` int64, ``logprobs: [N]`` float32), and being
    copied to the host. On a GPU the copy is asynchronous (to pinned memory) and an event marks its end, so
    :meth:`result` waits for this step's sampling only, not for work queued after it (the next decode step)."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        self.tokens, self.logprobs = tokens, logprobs
        self._ready: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = [tokens.to("cpu", non_blocking=True), logprobs.to("cpu", non_blocking=True)]
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = [tokens, logprobs]

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [N] int64, logprobs [N] float64)`` on the host, once the copy is done."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host[0].numpy().astype(np.int64), self._host[1].numpy().astype(np.float64)


def draw_rows(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float],
              uniform: Sequence[float]) -> DrawnTokens:
    """Samples one token for each row of ``logits: [N, V]`` (any float dtype; computed in fp32), row ``i``
    with ``temperature[i]`` (0 = greedy), ``top_p[i]`` and RNG draw ``uniform[i]`` (from
    :func:`request_uniforms`; all three of length ``N``): the tokens and their log-probabilities under
    ``logits / temperature[i]`` (untempered for greedy rows; see the module docstring), without waiting for the
    device.

    Greedy and plain rows go through ``kernels.sample_tokens`` (one Triton launch for CUDA logits, the torch
    reference elsewhere); top-p rows are then drawn again by the sort-based nucleus path."""
    if not logits.shape[0] == len(temperature) == len(top_p) == len(uniform):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(temperature)} temperatures, {len(top_p)} top-p "
                         f"values and {len(uniform)} uniform draws")
    device = logits.device
    host = torch.from_numpy(np.stack([np.asarray(temperature, dtype=np.float32), np.asarray(uniform, dtype=np.float32)]))
    if device.type == "cuda":
        host = host.pin_memory()
    temperature_d, uniform_d = host.to(device, non_blocking=True)
    tokens, logprobs = sample_tokens(logits, temperature_d, uniform_d)
    top_p_h = np.asarray(top_p, dtype=np.float32)
    nucleus = np.nonzero((top_p_h < 1.0) & (host[0].numpy() > 0.0))[0].tolist()
    if nucleus:
        index = lists_to_device([nucleus], device)[0]
        top_p_d = lists_to_device([top_p_h[nucleus].tolist()], device, torch.float32)[0]
        picked = logits.index_select(0, index).float()
        probs = torch.softmax(picked / temperature_d[index].clamp(min=MIN_TEMPERATURE)[:, None], dim=-1)
        chosen = _inverse_cdf_top_p(probs, uniform_d[index], top_p_d)
        tokens[index] = chosen
        logprobs[index] = picked.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)
    tempered = np.nonzero((host[0].numpy() > 0.0) & (host[0].numpy() != 1.0))[0].tolist()
    if tempered:  # the log-probs of the distribution drawn from: log_softmax(logits / T)
        index = lists_to_device([tempered], device)[0]
        scaled = logits.index_select(0, index).float() / temperature_d[index, None]
        logprobs[index] = scaled.gather(1, tokens[index, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
    return DrawnTokens(tokens, logprobs)


def sample_rows(logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float],
                uniform: Sequence[float]) -> tuple[list[int], list[float]]:
    """:func:`draw_rows`, waiting for its result: the tokens and their log-probabilities as lists."""
    tokens, logprobs = draw_rows(logits, temperature, top_p, uniform).result()
    return tokens.tolist(), logprobs.tolist()


def _inverse_cdf_top_p(probs: torch.Tensor, uniform: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling restricted to each row's nucleus (most likely tokens up to mass ``top_p``)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p[:, None]
    picked = inverse_cdf_ref(sorted_probs * keep, uniform)
    return order.gather(1, picked[:, None])[:, 0]
