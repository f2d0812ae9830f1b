"""Whole-run isolation checks on the embedded backend: what a run of ``skyrl_clora.main`` leaves for each
tenant (metrics, trainer state, served adapter, PEFT export), recorded, and the assertions that compare
tenants across runs and along the path the weights travel (trainer -> sampler, trainer -> export).

Used by ``test_isolation.py`` and, with bugs planted, by ``test_planted_bugs.py``: every check raises
``AssertionError`` on a violation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.helpers import record_built
from tests.support.micro_task import assert_learning, read_records
from skyrl_clora.backends.embedded import backend as embedded_backend
from skyrl_clora.backends.skyrl.backend import STEP_PHASES
from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.main import main
from skyrl_clora.trainer.adapter_store import TABLES

# Metrics that differ between runs of the same tenant by construction (wall-clock times, pass sharing).
_RUN_DEPENDENT = ("rollout_s", "train_s", "sync_s", "train/pass_tenants", *(f"train/{phase}" for phase in STEP_PHASES))
# The sampler's log-probs match across batch compositions only to float rounding on the CPU (its GEMMs
# take other kernels for other row counts), so the trainer's gap to them is compared approximately.
_SAMPLER_GAP = "train/logprob_abs_diff_vs_sampler"
# How far rounding may move a packed tenant's weights from its weights alone, as a share of its learning rate
# (see assert_same_tenants): rounding moves them by a small fraction of lr, a leak between tenants by about lr a step.
WEIGHT_LR_SHARE = 0.02


@dataclass
class TenantResult:
    """One tenant at the end of a run: its metrics records (run-dependent keys dropped), its trainer state
    (``tables``: master, exp_avg, exp_avg_sq, grads as flat fp32 host tensors; ``step``; ``rng_state``; its
    base learning rate ``lr``), the weights the trainer publishes, the adapter the sampler serves, and the PEFT
    export."""

    records: list[dict[str, Any]]
    lr: float
    tables: dict[str, torch.Tensor]
    step: int
    rng_state: torch.Tensor
    weights: AdapterWeights
    served: AdapterWeights
    served_version: int
    exported: AdapterWeights


def run_recorded(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> dict[str, TenantResult]:
    """Runs ``main(args)`` (exit status 0 asserted), keeping the services every group of tenants ran on, and
    returns each finished tenant's :class:`TenantResult`."""
    original = embedded_backend.build_services
    built = record_built(monkeypatch, embedded_backend, "build_services")
    assert main(args) == 0
    monkeypatch.setattr(embedded_backend, "build_services", original)
    out = Path(next(arg.split("=", 1)[1] for arg in args if arg.startswith("clora.output_dir=")))
    results = {}
    for services in built:
        for name, state in services.store.tenants.items():
            services.store.wait(name)
            results[name] = TenantResult(
                records=tenant_records(out, name), lr=state.schedule.base_lr,
                tables={table: state.flat[table].clone() for table in TABLES},
                step=state.step, rng_state=state.rng_state.clone(), weights=_cloned(state.weights),
                served=services.engine.engine.adapters.read(name, state.rank, state.alpha),
                served_version=services.engine.adapter_version(name),
                exported=load_peft_adapter(out / "adapters" / name),
            )
    return results


def _cloned(weights: AdapterWeights) -> AdapterWeights:
    copy = AdapterWeights(rank=weights.rank, alpha=weights.alpha)
    copy.a = {path: tensor.detach().clone() for path, tensor in weights.a.items()}
    copy.b = {path: tensor.detach().clone() for path, tensor in weights.b.items()}
    return copy


def assert_tenants_trained_apart(results: dict[str, TenantResult]) -> None:
    """The precondition of every comparison: each tenant learnt (varying rewards, non-zero gradients), its
    LoRA B and Adam moments moved off their zero start, and no two tenants hold the same weights."""
    assert_learning([record for result in results.values() for record in result.records])
    for name, result in results.items():
        assert result.tables["exp_avg"].abs().sum() > 0 and result.tables["exp_avg_sq"].abs().sum() > 0, name
        assert any(b.abs().sum() > 0 for b in result.weights.b.values()), f"{name}'s LoRA B never moved"
    names = sorted(results)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            x, y = results[first].weights, results[second].weights
            rank = min(x.rank, y.rank)
            assert any(not torch.equal(x.b[p][:, :rank], y.b[p][:, :rank]) for p in x.b), f"{first} and {second} share B"


def assert_weights_travel_intact(results: dict[str, TenantResult]) -> None:
    """Per tenant: the sampler serves exactly the weights the trainer holds, at the version of its last
    step, and the PEFT export holds the same A and B (and rank and alpha)."""
    for name, result in results.items():
        steps = [r for r in result.records if r["event"] == "step"]
        assert result.served_version == steps[-1]["adapter_version"] == len(steps), name
        for other, label in ((result.served, "served"), (result.exported, "exported")):
            assert (other.rank, other.alpha) == (result.weights.rank, result.weights.alpha), (name, label)
            assert set(other.a) == set(result.weights.a) and set(other.b) == set(result.weights.b), (name, label)
            for path in result.weights.a:
                assert torch.equal(other.a[path].float(), result.weights.a[path].float()), (name, label, path, "A")
                assert torch.equal(other.b[path].float(), result.weights.b[path].float()), (name, label, path, "B")
        master = result.tables["master"]
        published = torch.cat([t.float().flatten() for path in result.weights.a
                               for t in (result.weights.a[path], result.weights.b[path])])
        assert torch.equal(published, master.to(result.weights.a[next(iter(result.weights.a))].dtype).float()), name


def assert_same_records(got: list[dict[str, Any]], want: list[dict[str, Any]], name: str, exact: bool = True) -> None:
    """A tenant's metrics records equal, key by key (floats to rounding unless ``exact``; the sampler gap always)."""
    assert len(got) == len(want), f"{name}'s metrics differ"
    for first, second in zip(got, want):
        assert first.keys() == second.keys(), f"{name}'s metrics differ"
        for key, value in second.items():
            approximate = key == _SAMPLER_GAP or (not exact and isinstance(value, float))
            expected = pytest.approx(value, rel=1e-5, abs=1e-6) if approximate else value
            assert first[key] == expected, f"{name}'s {key} differs at {second['event']} {second['step']}"


def without_run_dependent(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` without the keys that differ between runs of the same work (wall times)."""
    return [{k: v for k, v in r.items() if k not in _RUN_DEPENDENT and "trajectory_time" not in k} for r in records]


def tenant_records(out: Path, name: str) -> list[dict[str, Any]]:
    """``name``'s records of the run in ``out``, without the run-dependent keys."""
    return without_run_dependent([r for r in read_records(out) if r.get("tenant") == name])


def assert_same_tenants(got: dict[str, TenantResult], want: dict[str, TenantResult], exact: bool = True) -> None:
    """Per tenant: metrics, optimizer state (masters, both moments, gradients, step, RNG), published, served
    and exported A and B; bit for bit when ``exact``, else to float rounding as AdamW carries it (a packed pass
    computes its tenants' rows in one batch, whose CPU GEMMs round differently from a batch of one tenant's rows):

    - moments and gradients within ``1e-3`` of their table's largest entry (rounding leaves them ~1e-5 apart);
    - weights (masters, A, B) within ``WEIGHT_LR_SHARE`` of the tenant's learning rate. AdamW moves every weight by
      about ``lr`` a step whatever its gradient's size, so an entry whose gradient is near zero (of the order of
      Adam's ``eps``) moves by a rounding-sensitive fraction of ``lr``, and a tensor whose entries all moved that
      way can differ by that fraction of ``lr`` relative to its own largest entry. Anything of another tenant
      reaching a pack changes gradients at their own scale and weights by about ``lr`` a step."""
    assert sorted(got) == sorted(want)

    def same(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0) -> bool:
        if exact:
            return torch.equal(a, b)
        return a.shape == b.shape and float((a - b).abs().max()) <= max(1e-3 * float(b.abs().max()), atol)

    for name in want:
        x, y = got[name], want[name]
        weight_atol = WEIGHT_LR_SHARE * y.lr
        assert_same_records(x.records, y.records, name, exact)
        assert x.step == y.step and torch.equal(x.rng_state, y.rng_state), name
        for table in TABLES:
            assert same(x.tables[table], y.tables[table], weight_atol if table == "master" else 0.0), \
                f"{name}'s {table} differs"
        for label in ("weights", "served", "exported"):
            a, b = getattr(x, label), getattr(y, label)
            for path in b.a:
                assert same(a.a[path], b.a[path], weight_atol) and same(a.b[path], b.b[path], weight_atol), \
                    (name, label, path)
