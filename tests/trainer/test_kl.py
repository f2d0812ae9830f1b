"""SkyRL's KL penalty on rewards (:mod:`skyrl_clora.trainer.kl`): a tenant's reward KL controller is SkyRL's, fixed or
adaptive, continuing from the tenant's value; the penalty is the masked per-token KL times the controller's
coefficient (never negative), with SkyRL's ``avg_kl`` and the coefficient applied, and the controller updated after."""

from __future__ import annotations

import pytest
import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import AdaptiveKLController, FixedKLController
from skyrl.train.config import AlgorithmConfig, KLCtrlConfig

from skyrl_clora.trainer.kl import kl_reward_penalty, tenant_kl_controller

LOG_PROBS = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -2.0]])
BASE = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
# k1 (log p - log p_base) on the trained tokens: [[0.5, 0], [0.5]]; row means 0.25 and 0.5


def _algorithm(coef: float, kind: str = "fixed") -> AlgorithmConfig:
    return AlgorithmConfig(use_kl_loss=False, use_kl_in_reward=True, kl_loss_coef=coef, kl_estimator_type="k1",
                           kl_ctrl=KLCtrlConfig(type=kind, kl_target=0.1, horizon=10))


def test_a_tenants_controller_is_skyrls_and_continues_from_its_value() -> None:
    fixed = tenant_kl_controller(_algorithm(0.3), None)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    assert tenant_kl_controller(_algorithm(0.3), 0.05).value == 0.05
    adaptive = tenant_kl_controller(_algorithm(0.3, "adaptive"), 0.7)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.7
    assert (adaptive.target, adaptive.horizon) == (0.1, 10)
    assert tenant_kl_controller(_algorithm(0.3, "adaptive"), None).value == 0.3


def test_the_penalty_is_the_masked_kl_times_the_coefficient() -> None:
    penalty, metrics = kl_reward_penalty(LOG_PROBS, BASE, MASK, _algorithm(0.2))
    torch.testing.assert_close(penalty, torch.tensor([[0.1, 0.0, 0.0], [0.1, 0.0, 0.0]]))
    assert metrics == {"avg_kl": pytest.approx(0.375), "kl_loss_coef": 0.2}
    negative, metrics = kl_reward_penalty(LOG_PROBS, BASE, MASK, _algorithm(-1.0))
    assert not negative.any() and metrics["kl_loss_coef"] == -1.0  # SkyRL's max(0, coef)


def test_the_controllers_coefficient_applies_and_it_updates_after_the_step() -> None:
    controller = tenant_kl_controller(_algorithm(0.2, "adaptive"), 0.5)
    penalty, metrics = kl_reward_penalty(LOG_PROBS, BASE, MASK, _algorithm(0.2, "adaptive"), controller)
    torch.testing.assert_close(penalty, torch.tensor([[0.25, 0.0, 0.0], [0.25, 0.0, 0.0]]))
    assert metrics["kl_loss_coef"] == 0.5
    reference = AdaptiveKLController(init_kl_coef=0.5, target=0.1, horizon=10)
    reference.update(current=0.375, n_steps=2)  # KL above the target: the coefficient grows
    assert controller.value == pytest.approx(reference.value) and controller.value > 0.5
