"""The driver's check of a worker's step report (``check_step_report``): SkyRL's FSDP and Megatron workers
all-reduce ``policy_lr`` as float32, so it is compared with the tenant's scheduled LR within float32 rounding, and
anything further off (another step's or another tenant's LR) is still refused."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.backends.skyrl.backend import check_step_report


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("strategy", ["megatron", "fsdp2"])
def test_a_float32_rounded_lr_report_is_this_steps(strategy: str) -> None:
    lr = 3e-6
    assert _float32(lr) != lr  # the exact comparison this replaces raised here
    reported = {"policy_lr": _float32(lr)}
    check_step_report("t", lr, 0.5, reported, {"lr": _float32(lr), "grad_norm": 0.5}, strategy)


@pytest.mark.parametrize("wrong", [3.1e-6, 1e-6])
def test_an_lr_report_beyond_float32_rounding_is_refused(wrong: float) -> None:
    with pytest.raises(RuntimeError, match="tenant t: the worker reports .*policy_lr"):
        check_step_report("t", 3e-6, 0.5, {"policy_lr": _float32(wrong)}, {"lr": 3e-6}, "megatron")


def test_the_embedded_workers_grad_norm_must_match_exactly() -> None:
    with pytest.raises(RuntimeError, match="grad_norm"):
        check_step_report("t", 1e-3, 0.5, {"policy_lr": 1e-3}, {"lr": 1e-3, "grad_norm": _float32(0.1)}, "embedded")
