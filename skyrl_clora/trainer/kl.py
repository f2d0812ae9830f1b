"""SkyRL's KL penalty on rewards (``use_kl_in_reward``), shared by the embedded trainer and backend=skyrl's driver."""

from __future__ import annotations

import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import (
    AdaptiveKLController, FixedKLController, compute_approx_kl, get_kl_controller,
)
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.train.config import AlgorithmConfig

KLController = AdaptiveKLController | FixedKLController


def tenant_kl_controller(algorithm: AlgorithmConfig, value: float | None) -> KLController:
    """SkyRL's reward KL controller for ``algorithm`` (``get_kl_controller``: ``kl_ctrl.type`` fixed or adaptive,
    starting at ``kl_loss_coef``), at ``value`` when given (a tenant's controller continues from its value)."""
    controller = get_kl_controller(algorithm)
    if value is not None:
        controller.value = value
    return controller


def kl_reward_penalty(log_probs: torch.Tensor, base_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                      algorithm: AlgorithmConfig, controller: KLController | None = None,
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """What SkyRL's ``RayPPOTrainer.apply_reward_kl_penalty`` subtracts from the token-level rewards ``[B, L]``:
    ``kl * max(0, coef)``, ``kl`` being ``compute_approx_kl`` of the policy's and the reference's log-probs with
    ``kl_estimator_type`` (zero where ``loss_mask`` is) and ``coef`` the ``controller``'s value (None:
    ``kl_loss_coef``, the fixed controller's); then, as SkyRL does, ``controller.update(avg_kl, B)``. Returns the
    penalty and SkyRL's metrics: ``avg_kl`` (each row's masked token mean averaged over the rows) and
    ``kl_loss_coef`` (the coefficient applied)."""
    kl = compute_approx_kl(log_probs, base_log_probs, loss_mask=loss_mask, kl_estimator_type=algorithm.kl_estimator_type)
    coef = controller.value if controller is not None else algorithm.kl_loss_coef
    avg_kl = masked_mean(kl, loss_mask, dim=-1).mean().item()
    if controller is not None:
        controller.update(current=avg_kl, n_steps=kl.shape[0])
    return kl * max(0.0, coef), {"avg_kl": avg_kl, "kl_loss_coef": float(coef)}
