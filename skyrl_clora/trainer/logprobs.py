"""Log-probabilities of chosen tokens from hidden states, without materialising ``[tokens, vocab]`` at once.

The trainer needs the log-prob of each response token only. Computing the LM head over every position of
a ``[B, L]`` batch in fp32 costs ``B * L * V * 4`` bytes (tens of GB for Qwen3's 151k vocabulary); here the
head runs over the gathered response positions only, a chunk of rows at a time, and the backward
recomputes each chunk's logits instead of keeping them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _TokenLogprobs(torch.autograd.Function):
    """``out[n] = log_softmax(float(hidden[n] @ weight.T + bias))[targets[n]]``, chunked over ``n``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start : start + chunk], weight, bias).float()
            picked = logits.gather(1, targets[start : start + chunk, None])[:, 0]
            out[start : start + chunk] = picked - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            logits = F.linear(hidden[start:end], weight, bias).float()
            grad = grad_out[start:end, None]
            # d out / d logits = onehot(target) - softmax(logits)
            dlogits = torch.softmax(logits, dim=-1).mul_(-grad)
            dlogits.scatter_add_(1, targets[start:end, None], grad)
            grad_hidden[start:end] = dlogits.to(weight.dtype) @ weight
        return grad_hidden, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, max_logits: int = 1 << 27
) -> torch.Tensor:
    """Returns ``[N]`` fp32: ``log_softmax(head(hidden).float(), -1).gather(-1, targets)`` for ``hidden: [N, H]``
    (model dtype), ``targets: [N]`` int64. The head's logits are computed in the model dtype and rounded to
    fp32 before the softmax, as ``model(...).logits.float()`` would be. At most ``max_logits`` logits
    (``rows * V``) exist at a time. Differentiable in ``hidden``; the head must be frozen."""
    if head.weight.requires_grad:
        raise ValueError("token_logprobs needs a frozen LM head (the trainer trains LoRA adapters only)")
    chunk = max(1, max_logits // head.weight.shape[0])
    return _TokenLogprobs.apply(hidden, head.weight, head.bias, targets, chunk)
