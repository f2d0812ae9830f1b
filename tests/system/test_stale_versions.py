"""A trajectory sampled with another adapter version than its tenant's step expects fails that tenant loudly,
on both backends; the other tenants finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

from tests.support.helpers import record_built
from tests.support.micro_task import micro_tenants, read_records, run_args
from skyrl_clora.backends.skyrl import backend as skyrl_backend
from skyrl_clora.backends.embedded import backend as embedded_backend
from skyrl_clora.main import main

pytestmark = pytest.mark.e2e
TENANTS = micro_tenants({"name": "a", "seed": 1}, {"name": "stale", "seed": 2})


def _statuses(out: Path) -> dict[str, str]:
    summary = json.loads((out / "summary.json").read_text())
    return {row["tenant"]: row["status"] for row in summary["per_tenant"]}


def _assert_only_stale_failed(out: Path, expected: str) -> None:
    assert _statuses(out) == {"a": "ok", "stale": "failed"}
    failed = [r for r in read_records(out) if r["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["tenant"] == "stale" and expected in failed[0]["error"], failed


def run_with_stale_rollout(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> int:
    """Runs ``main(args)`` on the embedded backend with one extra publish of tenant ``stale``'s adapter landing
    after its first training rollout is sampled and before that rollout is checked; returns the exit status."""
    built = record_built(monkeypatch, embedded_backend, "build_services")
    original_generate = SkyRLGymGenerator.generate
    calls: dict[str, int] = {}

    async def generate_then_publish(self, batch, **kwargs):
        output = await original_generate(self, batch, **kwargs)
        calls[self.policy_model_name] = calls.get(self.policy_model_name, 0) + 1
        if self.policy_model_name == "stale" and calls["stale"] == 2:  # after eval 0: step 1's rollout
            services = built[0]
            await services.sync.publish("stale", services.store.tenants["stale"].weights)
        return output

    monkeypatch.setattr(SkyRLGymGenerator, "generate", generate_then_publish)
    return main(args)


def test_embedded_stale_trajectory_fails_its_tenant(micro_model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "embedded"
    assert run_with_stale_rollout(monkeypatch, run_args(micro_model_dir, out, TENANTS, steps=2)) == 1
    _assert_only_stale_failed(out, "tenant stale: trajectory s2-s1-p0_0 sampled with adapter versions [0]; its step began at version 0 and the tenant is at 1")


@pytest.mark.usefixtures("without_production_extras")
@pytest.mark.ray
def test_skyrl_stale_trajectory_fails_its_tenant(micro_model_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """backend=skyrl: the tenant's adapter is loaded again on the server (a sync from elsewhere) after its
    step fixed the version its rollout must be sampled with, so the rollout reports a newer version."""
    stacks = record_built(monkeypatch, skyrl_backend, "build_stack")
    original_generate = SkyRLGymGenerator.generate
    calls: dict[str, int] = {}

    async def reload_then_generate(self, batch, **kwargs):
        calls[self.policy_model_name] = calls.get(self.policy_model_name, 0) + 1
        if self.policy_model_name == "stale" and calls["stale"] == 2:
            await self.inference_engine_client.load_lora_adapter("stale", str(Path(stacks[0].sync_path) / "stale"))
        return await original_generate(self, batch, **kwargs)

    monkeypatch.setattr(SkyRLGymGenerator, "generate", reload_then_generate)
    out = tmp_path / "skyrl"
    assert main(run_args(micro_model_dir, out, TENANTS, "backend=skyrl", steps=2)) == 1
    _assert_only_stale_failed(out, "tenant stale: trajectory s2-s1-p0_0 sampled with adapter versions [1]; its step began at version 0 and the tenant is at 1")
