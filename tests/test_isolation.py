"""Tenants are isolated end to end on the embedded backend: three tenants with different seeds, learning
rates, ranks and alphas learn on the micro task, and each ends the same whether it ran alone (serial
mode: its own services) or beside the others (concurrent mode): bit for bit in swap training, to float
rounding in packed training; along the way the sampler serves and the export holds exactly the trainer's
weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from isolation import (
    assert_same_tenants,
    assert_tenants_trained_apart,
    assert_weights_travel_intact,
    run_recorded,
)
from micro_task import micro_tenants, read_records, run_args

TENANTS = micro_tenants(
    {"name": "a", "seed": 1, "lr": "1e-2"},
    {"name": "b", "seed": 2, "lr": "3e-3", "rank": 4},
    {"name": "c", "seed": 3, "lr": "5e-3", "alpha": 8},
)


def isolation_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return run_args(model_dir, out, TENANTS, *extra)


def test_tenants_learn_the_micro_task(learning_model_dir: Path, tmp_path: Path) -> None:
    """Five steps raise every tenant's mean reward well above its first step's (the task is learnable, so
    the end-to-end tests on it train something)."""
    out = tmp_path / "learn"
    from skyrl_clora.main import main

    assert main(run_args(learning_model_dir, out, TENANTS, steps=5)) == 0
    records = read_records(out)
    for name in "abc":
        rewards = [r["reward_mean"] for r in records if r["event"] == "step" and r["tenant"] == name]
        assert len(rewards) == 5 and rewards[-1] > rewards[0] + 0.1, (name, rewards)


@pytest.mark.parametrize("train_mode", ["swap", "packed"])
def test_a_tenant_ends_the_same_alone_or_beside_others(train_mode: str, learning_model_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    mode = f"clora.train_mode={train_mode}"
    together = run_recorded(monkeypatch, isolation_args(learning_model_dir, tmp_path / "together", mode))
    assert_tenants_trained_apart(together)
    assert_weights_travel_intact(together)
    alone = run_recorded(monkeypatch, isolation_args(learning_model_dir, tmp_path / "alone", mode, "clora.mode=serial"))
    assert_weights_travel_intact(alone)
    assert_same_tenants(together, alone, exact=train_mode == "swap")
