"""Per-tenant overrides of SkyRL keys that only change the tenant's own sampling or update (``tenants.PER_TENANT_SKYRL``):
they reach the tenant's spec, its trainer state and its sampling requests, and nobody else's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.micro_task import micro_tenants, run_args
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.main import main
from skyrl_clora.sampler.engine_thread import EngineThread


def test_overrides_reach_the_tenants_spec_and_only_its(tmp_path: Path) -> None:
    cfg = compose_config([f"clora.output_dir={tmp_path}", "+tenants=[{advantage_estimator:rloo,eps_clip_high:0.3,"
                          "kl_loss_coef:0.2,weight_decay:0.1,temperature:0.5,top_p:0.8,max_grad_norm:0.5,"
                          "policy_loss_type:gspo},{}]"])
    first, second = build_run_config(cfg).tenants
    assert first.algorithm_overrides() == {"advantage_estimator": "rloo", "eps_clip_high": 0.3, "kl_loss_coef": 0.2,
                                           "policy_loss_type": "gspo"}
    assert (first.weight_decay, first.temperature, first.top_p, first.max_grad_norm) == (0.1, 0.5, 0.8, 0.5)
    assert second.algorithm_overrides() == {}
    assert (second.weight_decay, second.temperature, second.top_p, second.max_grad_norm) == (None,) * 4


@pytest.mark.parametrize("override, message", [
    ("top_p:0", "top_p=0.0 must be in (0, 1]"), ("max_grad_norm:0", "max_grad_norm=0.0 must be positive"),
    ("policy_loss_type:nope", "policy_loss_type"),
])
def test_a_bad_override_is_one_line_naming_it(override: str, message: str, tmp_path: Path) -> None:
    from skyrl_clora.config.schema import ConfigError

    cfg = compose_config([f"clora.output_dir={tmp_path}", f"+tenants=[{{{override}}},{{}}]"])
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        build_run_config(cfg)
    assert "\n" not in str(error.value)


def test_a_tenants_temperature_and_top_p_are_its_requests_alone(learning_model_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str | None, set[tuple[float, float]]] = {}
    submit = EngineThread.submit

    def recording(self, prompt_ids, adapter, params):
        seen.setdefault(adapter, set()).add((params.temperature, params.top_p))
        return submit(self, prompt_ids, adapter, params)

    monkeypatch.setattr(EngineThread, "submit", recording)
    args = run_args(learning_model_dir, tmp_path / "run", micro_tenants({"temperature": 0.25}, {"top_p": 0.5}, {}),
                    steps=1)
    assert main([*args, "generator.sampling_params.temperature=0.9", "trainer.eval_interval=0"]) == 0
    assert seen == {"tenant-0": {(0.25, 1.0)}, "tenant-1": {(0.9, 0.5)}, "tenant-2": {(0.9, 1.0)}}
