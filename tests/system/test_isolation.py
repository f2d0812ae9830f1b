"""Tenants are isolated end to end on the embedded backend: three tenants with different seeds, learning
rates, ranks and alphas learn on the micro task, and each ends the same whether it ran alone (serial
mode: its own services) or beside the others (concurrent mode): bit for bit in swap training, to float
rounding in packed training; along the way the sampler serves and the export holds exactly the trainer's
weights.

Packed runs here use ``clora.pack_policy=lockstep``: every step packs all three tenants in one pass, so the
rounding a run meets is the same on any machine. The default ``ready`` policy packs whoever waits, which depends
on timing; every pack it can form is compared with each tenant trained alone in
``trainer/test_trainer_packed.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.isolation import (
    assert_same_records,
    assert_same_tenants,
    assert_tenants_trained_apart,
    assert_weights_travel_intact,
    run_recorded,
    tenant_records,
)
from tests.support.micro_task import assert_learning, micro_tenants, read_records, run_args
from skyrl_clora.backends.skyrl.backend import STEP_PHASES
from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.main import main
from skyrl_clora.sampler.scheduler import Scheduler

TENANTS = micro_tenants(
    {"name": "a", "seed": 1, "lr": "1e-2"},
    {"name": "b", "seed": 2, "lr": "3e-3", "rank": 4},
    {"name": "c", "seed": 3, "lr": "5e-3", "alpha": 8},
)

pytestmark = pytest.mark.e2e


def isolation_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return run_args(model_dir, out, TENANTS, *extra)


def test_tenants_learn_the_micro_task(learning_model_dir: Path, tmp_path: Path) -> None:
    """Five steps raise every tenant's mean reward well above its first step's (the task is learnable, so
    the end-to-end tests on it train something)."""
    out = tmp_path / "learn"
    assert main(run_args(learning_model_dir, out, TENANTS, steps=5)) == 0
    records = read_records(out)
    for name in "abc":
        rewards = [r["reward_mean"] for r in records if r["event"] == "step" and r["tenant"] == name]
        assert len(rewards) == 5 and rewards[-1] > rewards[0] + 0.1, (name, rewards)


@pytest.mark.parametrize("train_mode", ["swap", "packed"])
def test_a_tenant_ends_the_same_alone_or_beside_others(train_mode: str, learning_model_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    mode = ["clora.train_mode=swap"] if train_mode == "swap" else ["clora.train_mode=packed", "clora.pack_policy=lockstep"]
    together = run_recorded(monkeypatch, isolation_args(learning_model_dir, tmp_path / "together", *mode))
    assert_tenants_trained_apart(together)
    assert_weights_travel_intact(together)
    alone = run_recorded(monkeypatch, isolation_args(learning_model_dir, tmp_path / "alone", *mode, "clora.mode=serial"))
    assert_weights_travel_intact(alone)
    assert_same_tenants(together, alone, exact=train_mode == "swap")


@pytest.mark.usefixtures("without_production_extras")
@pytest.mark.ray
def test_a_tenant_ends_the_same_alone_or_beside_others_on_skyrls_stack(learning_model_dir: Path, tmp_path: Path) -> None:
    """backend=skyrl (SkyRL's generator, WorkerDispatch and a Ray policy worker): a tenant run beside another
    ends with the metrics and exported adapter it has when it runs alone (one alone run: each costs a Ray
    stack; the embedded test above covers every tenant). Each step record holds the seconds of the update's parts
    (``STEP_PHASES``: all but the lock wait inside ``train_s``) and the summary each tenant's registration and the cold
    start's parts."""
    specs = ({"name": "a", "seed": 1, "lr": "1e-2"}, {"name": "b", "seed": 2, "lr": "3e-3"})  # one rank: SkyRL's store
    assert main(run_args(learning_model_dir, tmp_path / "together", micro_tenants(*specs), "backend=skyrl")) == 0
    assert_learning(read_records(tmp_path / "together"))
    for record in [r for r in read_records(tmp_path / "together") if r["event"] == "step"]:
        phases = {phase: record[f"train/{phase}"] for phase in STEP_PHASES}
        assert min(phases.values()) >= 0, record
        assert min(phases["swap_s"], phases["recompute_s"], phases["forward_backward_s"], phases["optim_s"]) > 0, record
        assert sum(phases.values()) - phases["lock_wait_s"] <= record["train_s"], record
    summary = json.loads((tmp_path / "together" / "summary.json").read_text())
    registered, parts = summary["register_seconds"], summary["cold_start_parts_seconds"]
    assert sorted(registered) == ["a", "b"] and min(registered.values()) > 0
    assert sorted(parts) == ["inference", "policy_workers", "ray"] and min(parts.values()) > 0, "no peak off a GPU"
    assert sum(parts.values()) <= summary["cold_start_seconds"][0]
    exported = {name: load_peft_adapter(tmp_path / "together" / "adapters" / name) for name in "ab"}
    path = next(iter(exported["a"].b))
    assert exported["a"].b[path].abs().sum() > 0 and not torch.equal(exported["a"].b[path], exported["b"].b[path])
    for spec in specs[1:]:
        name, out = spec["name"], tmp_path / f"alone-{spec['name']}"
        assert main(run_args(learning_model_dir, out, micro_tenants(spec), "backend=skyrl")) == 0
        assert_same_records(tenant_records(tmp_path / "together", name), tenant_records(out, name), name)
        alone = load_peft_adapter(out / "adapters" / name)
        for part in ("a", "b"):
            for key, tensor in getattr(alone, part).items():
                assert torch.equal(getattr(exported[name], part)[key], tensor), (name, part, key)


def test_renaming_a_tenant_changes_none_of_its_results(learning_model_dir: Path, tmp_path: Path) -> None:
    """Only what defines an experiment (seed, data, hyper-parameters) sets its results, never its name."""
    runs = {}
    for name in ("first", "a-quite-different-name"):
        out = tmp_path / name
        assert main(run_args(learning_model_dir, out, micro_tenants({"name": name, "seed": 5, "lr": "1e-2"}))) == 0
        runs[name] = [{k: v for k, v in r.items() if k != "tenant"} for r in tenant_records(out, name)]
    assert_learning(read_records(tmp_path / "first"))
    assert_same_records(runs["a-quite-different-name"], runs["first"], "renamed")


@pytest.mark.parametrize("extra", [[], ["sampler.max_rows=4", "sampler.adapter_slots=2"]], ids=["default", "scarce"])
def test_fair_admission_changes_no_tenants_results(extra: list[str], learning_model_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``sampler.admission=fair`` (the default) reorders admission across tenants (with rows and adapter slots scarce),
    and the CPU engine's rows are batch-invariant: every tenant ends bit for bit as in arrival order (swap training)."""
    args = ("clora.train_mode=swap", *extra)
    placed: list[str | None] = []
    place = Scheduler.place
    monkeypatch.setattr(Scheduler, "place", lambda self, request: (placed.append(request.adapter), place(self, request)))
    fifo = run_recorded(monkeypatch, isolation_args(learning_model_dir, tmp_path / "fifo", *args,
                                                    "sampler.admission=fifo"))
    fifo_order, placed[:] = list(placed), []
    fair = run_recorded(monkeypatch, isolation_args(learning_model_dir, tmp_path / "fair", *args))
    assert sorted(placed) == sorted(fifo_order)
    if extra:
        assert placed != fifo_order, "scarce rows and slots: the two orders admit differently"
    assert_tenants_trained_apart(fair)
    assert_same_tenants(fair, fifo, exact=True)
