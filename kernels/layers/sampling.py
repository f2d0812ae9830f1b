"""Token sampling for a whole decode step in one launch: Triton kernel and host wrapper.

Torch ops per step (softmax, the two-level inverse CDF, argmax, logsumexp, gathers) came to about 25 small
kernels; this fuses greedy and inverse-CDF sampling of every row, and the chosen tokens' untempered
log-probabilities, into one program per row that reads its logits once, plus one chunk again:

1. One pass over the row in chunks of ``block_v`` tokens keeps, per chunk, the maximum logit, the tempered
   mass ``sum(exp((l - chunk_max) / T))`` and the untempered ``sum(exp(l - chunk_max))`` in small vectors,
   and the row's first argmax. The next chunk is loaded before the current one is reduced.
2. The chunk masses rescaled to the row's maximum give the row's total and a cumulative sum over chunks:
   the target ``u * total`` picks the first chunk whose cumulative mass exceeds it (else the last chunk of
   positive mass).
3. That chunk is read again and a cumulative sum inside it picks the first token past the target, else
   its last token of positive probability.

Rounding differs from the torch reference (unnormalised probabilities, another summation order), so the
tokens differ only where the target lies within rounding of a cumulative sum. Semantics:
``reference.sample_tokens_ref``; entry point: ``dispatch.sample_tokens``. The grid depends only on ``N``;
no allocation beyond the outputs and no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from skyrl_clora.kernels.launch import cdiv, next_power_of_2
from skyrl_clora.kernels.reference import MIN_TEMPERATURE

_LOG2E = tl.constexpr(1.4426950408889634)
_MIN_TEMPERATURE = tl.constexpr(MIN_TEMPERATURE)


@triton.jit
def _sample_kernel(
    logits_ptr,
    temperature_ptr,
    uniform_ptr,
    tokens_ptr,
    logprobs_ptr,
    V,
    stride_row,
    BLOCK_V: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
):
    """One program per row; ``NUM_CHUNKS = cdiv(V, BLOCK_V)`` (a compile-time trip count, which the CPU
    interpreter needs), ``CHUNKS_P2 >= NUM_CHUNKS`` a power of two."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    temperature = tl.load(temperature_ptr + row)
    tempered = _LOG2E / tl.maximum(temperature, _MIN_TEMPERATURE)  # exp((l - m) / T) = exp2((l - m) * tempered)
    offs = tl.arange(0, BLOCK_V)
    chunk_ids = tl.arange(0, CHUNKS_P2)
    chunk_max = tl.full([CHUNKS_P2], float("-inf"), tl.float32)
    chunk_mass = tl.zeros([CHUNKS_P2], tl.float32)  # tempered, relative to the chunk's maximum
    chunk_sum = tl.zeros([CHUNKS_P2], tl.float32)  # untempered, likewise
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    nxt = tl.load(base + offs, mask=offs < V, other=float("-inf"))
    for c in range(NUM_CHUNKS):
        x = nxt.to(tl.float32)
        ahead = (c + 1) * BLOCK_V + offs  # past V (after the last chunk) the load is fully masked
        nxt = tl.load(base + ahead, mask=ahead < V, other=float("-inf"))
        cmax, carg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = cmax > best  # strict: ties keep the earlier chunk (torch.argmax returns the first maximum)
        best_idx = tl.where(better, c * BLOCK_V + carg, best_idx)
        best = tl.maximum(best, cmax)
        shifted = x - tl.where(cmax == float("-inf"), 0.0, cmax)  # a chunk of -inf only: zeros, not NaN
        here = chunk_ids == c
        chunk_max = tl.where(here, cmax, chunk_max)
        chunk_mass = tl.where(here, tl.sum(tl.exp2(shifted * tempered), axis=0), chunk_mass)
        chunk_sum = tl.where(here, tl.sum(tl.exp2(shifted * _LOG2E), axis=0), chunk_sum)

    row_max = tl.where(best == float("-inf"), 0.0, best)
    mass = chunk_mass * tl.exp2((chunk_max - row_max) * tempered)  # [CHUNKS_P2], 0 past the last chunk
    cdf = tl.cumsum(mass, axis=0)
    target = tl.load(uniform_ptr + row) * tl.sum(mass, axis=0)
    first = tl.min(tl.where(cdf > target, chunk_ids, CHUNKS_P2), axis=0)
    chunk = tl.minimum(first, tl.max(tl.where(mass > 0.0, chunk_ids, 0), axis=0))
    before = tl.sum(tl.where(chunk_ids == chunk, cdf - mass, 0.0), axis=0)  # mass ahead of the chunk

    start = chunk * BLOCK_V
    x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
    probs = tl.exp2((x - row_max) * tempered)
    past = before + tl.cumsum(probs, axis=0) > target
    offset = tl.minimum(tl.min(tl.where(past, offs, BLOCK_V), axis=0), tl.max(tl.where(probs > 0.0, offs, 0), axis=0))
    token = tl.where(temperature == 0.0, best_idx, start + offset)

    log_normaliser = best + tl.log(tl.sum(chunk_sum * tl.exp2((chunk_max - row_max) * _LOG2E), axis=0))
    chosen = tl.load(base + token).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - log_normaliser)


def sample_tokens_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    *,
    block_v: int = 8192,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``sample_tokens`` (semantics: ``reference.sample_tokens_ref``).

    Shapes: ``logits: [N, V]`` (any float dtype, read as is and computed in fp32; unit column stride, else
    copied), ``temperature, uniform: [N]`` float32 (``temperature == 0``: greedy). Returns ``(tokens [N]
    int64, logprobs [N] float32)`` on ``logits``' device. Torch pseudo-code, per row::

        if temperature == 0:
            token = argmax(logits)                                  # the first maximum
        else:
            p = exp((logits - max(logits)) / temperature)
            token = first index with cumsum(p)[token] > u * sum(p)  # else the last index with p > 0
        logprob = logits[token] - logsumexp(logits)

    ``block_v`` (a power of two): tokens per chunk of the row's loop; one kernel is compiled per
    ``(V, block_v)``.
    """
    num, vocab = logits.shape
    if temperature.shape != (num,) or uniform.shape != (num,):
        raise ValueError(f"sample_tokens needs temperature and uniform of shape ({num},), got "
                         f"{tuple(temperature.shape)} and {tuple(uniform.shape)}")
    if block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(num, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num, dtype=torch.float32, device=logits.device)
    if num == 0:
        return tokens, logprobs
    chunks = cdiv(vocab, block_v)
    _sample_kernel[(num,)](
        logits, temperature.float().contiguous(), uniform.float().contiguous(), tokens, logprobs, vocab,
        logits.stride(0), BLOCK_V=block_v, NUM_CHUNKS=chunks, CHUNKS_P2=max(2, next_power_of_2(chunks)),
        num_warps=num_warps,
    )
    return tokens, logprobs
