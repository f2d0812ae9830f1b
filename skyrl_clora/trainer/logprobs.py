"""Log-probabilities of chosen tokens from hidden states, without materialising ``[tokens, vocab]`` at once.

The trainer needs the log-prob of each response token only. Computing the LM head over every position of
a ``[B, L]`` batch in fp32 costs ``B * L * V * 4`` bytes (tens of GB for Qwen3's 151k vocabulary); here the
head runs over the gathered response positions only, a chunk of rows at a time. A chosen token's
log-prob has the gradient ``onehot - softmax`` with respect to its row's logits whatever the loss is, so
when a gradient is needed the forward also computes ``G = (onehot - softmax) @ W`` per chunk (``G: [N, H]``,
the hidden states' gradient per unit of ``d loss / d out``) and the backward only scales it: the head's
GEMM runs twice per token, not three times (forward, a recompute, backward), and no logits are kept.

With a ``temperature`` the logits are divided by it first, as SkyRL's policy forward does (``logits.div_(temperature)``
in its model wrappers): the log-probs are those of the distribution sampled at that temperature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from skyrl.train.config import AlgorithmConfig

from skyrl_clora.kernels import chosen_logprobs_


class _TokenLogprobs(torch.autograd.Function):
    """``out[n] = log_softmax(float(hidden[n] @ weight.T + bias) / temperature[n])[targets[n]]``, chunked over ``n``
    (``temperature`` None: 1)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        temperature: torch.Tensor | None,
    ) -> torch.Tensor:
        need_grad = ctx.needs_input_grad[0]
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        basis = hidden.new_empty(hidden.shape) if need_grad else None  # [N, H]: d out[n] / d hidden[n]
        for start in range(0, hidden.shape[0], chunk):
            end = start + chunk
            logits = F.linear(hidden[start:end], weight, bias)
            scale = None if temperature is None else temperature[start:end, None].to(logits.dtype)
            if scale is not None:
                logits.div_(scale)
            out[start:end] = chosen_logprobs_(logits, targets[start:end], write_grad=need_grad)
            if need_grad:  # logits now hold d out / d (logits / T); d out / d logits is that / T
                if scale is not None:
                    logits.div_(scale)
                torch.matmul(logits, weight, out=basis[start:end])
        ctx.save_for_backward(basis)
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        (basis,) = ctx.saved_tensors
        return (basis * grad_out[:, None]).to(basis.dtype), None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, max_logits: int = 1 << 27,
    temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns ``[N]`` fp32: ``log_softmax(head(hidden).float() / temperature[:, None], -1).gather(-1, targets)`` for
    ``hidden: [N, H]`` (model dtype), ``targets: [N]`` int64, ``temperature: [N]`` fp32 > 0 on ``hidden``'s device
    (None: no division, bit for bit). The head's logits are computed in the model dtype, divided by the temperature
    in that dtype (as SkyRL's ``logits.div_(temperature)``) and rounded to fp32 before the softmax. At most
    ``max_logits`` logits (``rows * V``) exist at a time. Differentiable in ``hidden``; the head must be frozen."""
    if head.weight.requires_grad:
        raise ValueError("token_logprobs needs a frozen LM head (the trainer trains LoRA adapters only)")
    chunk = max(1, max_logits // head.weight.shape[0])
    return _TokenLogprobs.apply(hidden, head.weight, head.bias, targets, chunk, temperature)


def training_temperature(algorithm: AlgorithmConfig) -> float:
    """The temperature a tenant's policy log-probs are computed at: SkyRL's ``trainer.algorithm.temperature`` (the
    sampling temperature unless set otherwise). None or 0 (greedy sampling, where SkyRL's ``logits / 0`` has no
    meaning) gives 1: the untempered distribution, the one the sampler reports greedy tokens' log-probs under."""
    temperature = algorithm.temperature
    return 1.0 if not temperature else float(temperature)
