"""SkyRL's loss reduction, applied to the advantages per policy mini-batch (both backends).

SkyRL's policy losses sum their per-token terms; the reduction (``trainer.algorithm.loss_reduction``) is folded
into the advantages beforehand, per mini-batch, by ``RayPPOTrainer._normalize_advantages`` calling
``apply_loss_reduction_to_advantages_minibatch``. :func:`reduce_advantages` is that step 2 over SkyRL's own
function, given what it needs: the mini-batch's rows, its prompt boundaries (``prompt_mean``),
``trainer.micro_train_batch_size_per_gpu`` (``token_mean_legacy``) and ``algorithm.max_seq_len``
(``seq_mean_token_sum_norm``). Summing the per-token policy loss of a mini-batch's rows, over any grouping of
them into micro-batches, then gives SkyRL's loss for that mini-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import apply_loss_reduction_to_advantages_minibatch
from skyrl.train.config import AlgorithmConfig
from skyrl.train.dataset.preprocess import compute_prompt_boundaries

LOSS_REDUCTIONS = ("token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")
"""The values of ``trainer.algorithm.loss_reduction`` SkyRL's ``validate_cfg`` accepts."""


def loss_reduction_problem(algorithm: AlgorithmConfig | dict) -> str | None:
    """Why SkyRL would refuse ``algorithm``'s loss reduction (one line naming the fix), or None."""
    get = algorithm.get if isinstance(algorithm, dict) else lambda key, default=None: getattr(algorithm, key, default)
    reduction = get("loss_reduction", "token_mean")
    if reduction not in LOSS_REDUCTIONS:
        return f"trainer.algorithm.loss_reduction={reduction} is unknown; use one of {', '.join(LOSS_REDUCTIONS)}"
    if reduction == "seq_mean_token_sum_norm" and get("max_seq_len") is None:
        return ("trainer.algorithm.loss_reduction=seq_mean_token_sum_norm needs trainer.algorithm.max_seq_len (the "
                "normalising sequence length, e.g. the context window), as SkyRL requires; set it")
    return None


def reduce_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor, group_ids: Sequence[str],
                      mini_batches: Sequence[Sequence[int]], algorithm: AlgorithmConfig,
                      micro_batch_size: int) -> torch.Tensor:
    """``advantages [N, L]`` with each mini-batch's rows (``mini_batches``: row indices, one list per mini-batch)
    scaled by SkyRL's ``apply_loss_reduction_to_advantages_minibatch`` for ``algorithm.loss_reduction``; rows in no
    mini-batch are 0. ``loss_mask [N, L]``: the trained tokens; ``group_ids[i]``: row ``i``'s prompt. A mini-batch's
    rows are taken in their order with each prompt's rows moved together (SkyRL's batches are already so), its
    prompt boundaries computed over that order. Raises ValueError where SkyRL would refuse the reduction."""
    problem = loss_reduction_problem(algorithm)
    if problem is not None:
        raise ValueError(problem)
    out = torch.zeros_like(advantages)
    for rows in mini_batches:
        first = {}
        for row in rows:
            first.setdefault(group_ids[row], len(first))
        order = sorted(rows, key=lambda row: first[group_ids[row]])  # stable: each prompt's rows in their order
        index = torch.tensor(order, dtype=torch.long)
        out[index] = apply_loss_reduction_to_advantages_minibatch(
            advantages[index], loss_mask[index], algorithm.loss_reduction, micro_batch_size=micro_batch_size,
            max_seq_len=algorithm.max_seq_len, prompt_boundaries=compute_prompt_boundaries([group_ids[r] for r in order]),
        )
    return out
