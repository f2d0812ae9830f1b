"""SkyRL's KL penalty on rewards (``use_kl_in_reward``), shared by the embedded trainer and backend=skyrl's driver."""

from __future__ import annotations

import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.train.config import AlgorithmConfig


def kl_reward_penalty(log_probs: torch.Tensor, base_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                      algorithm: AlgorithmConfig) -> tuple[torch.Tensor, float]:
    """What SkyRL's ``RayPPOTrainer.apply_reward_kl_penalty`` subtracts from the token-level rewards ``[B, L]``
    under its fixed KL controller (``kl_ctrl.type=fixed``: the coefficient is ``kl_loss_coef``): ``kl *
    max(0, kl_loss_coef)``, ``kl`` being ``compute_approx_kl`` of the policy's and the reference's log-probs with
    ``kl_estimator_type`` (zero where ``loss_mask`` is); and the batch's ``avg_kl``, each row's masked token mean
    averaged over the rows."""
    kl = compute_approx_kl(log_probs, base_log_probs, loss_mask=loss_mask, kl_estimator_type=algorithm.kl_estimator_type)
    return kl * max(0.0, algorithm.kl_loss_coef), masked_mean(kl, loss_mask, dim=-1).mean().item()
