"""Every ``trainer.algorithm.loss_reduction`` SkyRL accepts scales a tenant's advantages per mini-batch as SkyRL's
``_normalize_advantages`` does (its prompt boundaries, ``micro_train_batch_size_per_gpu``, ``max_seq_len``)."""

from __future__ import annotations

import pytest
import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import (
    apply_loss_reduction_to_advantages_minibatch, compute_advantages_and_returns,
)
from skyrl.train.config import AlgorithmConfig

from skyrl_clora.config.checks import check_algorithm
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.trainer.batch import TrainBatch, build_pass_rows
from skyrl_clora.trainer.loss_reduction import LOSS_REDUCTIONS


def _batch() -> TrainBatch:
    """4 prompts x 2 samples, responses of different lengths (so every reduction differs), mixed rewards."""
    responses = [[1] * n for n in (3, 5, 2, 7, 4, 4, 6, 1)]
    return TrainBatch(prompt_ids=[[9, 9]] * 8, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], group_ids=[f"p{i // 2}" for i in range(8)],
                      rollout_logprobs=None)


@pytest.mark.parametrize("reduction", LOSS_REDUCTIONS)
def test_each_loss_reduction_is_skyrls_per_mini_batch(reduction: str) -> None:
    algorithm = AlgorithmConfig(use_kl_loss=False, loss_reduction=reduction, max_seq_len=64)
    batch = _batch()
    rows = build_pass_rows([batch], [0], algorithm, torch.device("cpu"), mini_batch_prompts=2, micro_batch_size=2)
    mask = rows.response_mask
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(8), mask.sum(1).long() - 1] = torch.tensor(batch.rewards)
    raw, _ = compute_advantages_and_returns(token_level_rewards=rewards, response_mask=mask, index=batch.group_ids,
                                            adv_estimator="grpo", config=algorithm, grpo_norm_by_std=True)
    expected = torch.cat([apply_loss_reduction_to_advantages_minibatch(
        raw[start:start + 4], mask[start:start + 4], reduction, micro_batch_size=2, max_seq_len=64,
        prompt_boundaries=[(0, 2), (2, 4)]) for start in (0, 4)])
    torch.testing.assert_close(rows.advantages, expected)
    assert rows.advantages.abs().sum() > 0


def test_the_reductions_differ_and_seq_mean_token_sum_norm_needs_max_seq_len() -> None:
    tables = [build_pass_rows([_batch()], [0], AlgorithmConfig(use_kl_loss=False, loss_reduction=r, max_seq_len=64),
                              torch.device("cpu"), mini_batch_prompts=2, micro_batch_size=3).advantages
              for r in LOSS_REDUCTIONS]  # (2-row micro-batches would make token_mean_legacy prompt_mean here)
    assert all(not torch.allclose(a, b) for i, a in enumerate(tables) for b in tables[i + 1:])
    with pytest.raises(ConfigError, match="needs trainer.algorithm.max_seq_len"):
        check_algorithm({"loss_reduction": "seq_mean_token_sum_norm"})
    check_algorithm({"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 1024})
