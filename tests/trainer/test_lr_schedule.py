"""The tenants' LR schedules are SkyRL's: the LR of each optimizer step is the one the scheduler SkyRL's FSDP
strategy builds (``transformers.trainer.get_scheduler`` from ``optimizer_config``) gives, for every scheduler name
the config accepts, on both backends' paths (the run config's name, the embedded worker's SkyRL config)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.trainer import get_scheduler  # what skyrl's fsdp_strategy imports

from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.backends.skyrl.config_translation import translate
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.trainer.lr_schedule import LR_SCHEDULES, LRSchedule


def _skyrl_lrs(name: str, lr: float, warmup: int, total: int, steps: int) -> list[float]:
    """The LR each of ``steps`` optimizer steps runs at under SkyRL's scheduler: read before ``optimizer.step()``,
    then ``scheduler.step()``, as SkyRL's ``optim_step`` does."""
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([parameter], lr=lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        parameter.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("name", LR_SCHEDULES)
def test_each_accepted_scheduler_gives_skyrls_lr_sequence(name: str, warmup: int) -> None:
    schedule = LRSchedule(2e-3, warmup_steps=warmup, total_steps=10, kind=name)
    expected = _skyrl_lrs(name, 2e-3, warmup, 10, steps=14)  # past the horizon too
    assert [schedule.lr(k) for k in range(14)] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert len(set(expected)) > (1 if (warmup and name != "constant") or name == "cosine" else 0)


def test_warm_up_starts_at_zero_and_constant_ignores_it() -> None:
    assert [LRSchedule(1.0, 4, 10, "constant_with_warmup").lr(k) for k in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert [LRSchedule(1.0, 4, 10, "constant").lr(k) for k in range(3)] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        LRSchedule(1.0, kind="linear")


def test_the_scheduler_name_reaches_both_backends_as_skyrl_spells_it(tmp_path: Path) -> None:
    """backend=embedded's run config and backend=skyrl's worker config keep SkyRL's name (``constant`` is not
    ``constant_with_warmup``); Megatron, whose scheduler warms up whatever the name, refuses a warm-up it would add."""
    keys = ["trainer.policy.optimizer_config.scheduler=constant", "trainer.policy.optimizer_config.num_warmup_steps=3",
            f"clora.output_dir={tmp_path}"]
    assert build_run_config(compose_config(keys)).trainer.scheduler == "constant"
    skyrl = ["backend=skyrl", f"trainer.policy.model.path={tmp_path}", "backend.strategy=fsdp2", *keys]
    assert translate(compose_config(skyrl)).base.trainer.policy.optimizer_config.scheduler == "constant"
    with pytest.raises(ConfigError, match="Megatron scheduler is constant with linear warm-up"):
        translate(compose_config(["backend=skyrl", f"trainer.policy.model.path={tmp_path}", "trainer.strategy=megatron",
                                  *keys]))


def test_lr_schedule() -> None:
    schedule = LRSchedule(base_lr=1.0, warmup_steps=2, total_steps=10, kind="cosine")
    assert schedule.lr(0) == 0.0 and schedule.lr(1) == 0.5  # SkyRL's (HF's) warm-up: step k at k / warmup_steps
    assert schedule.lr(2) == pytest.approx(1.0) and schedule.lr(10) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        LRSchedule(base_lr=1.0, kind="exotic")
