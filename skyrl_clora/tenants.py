"""Tenants: the RL experiments of one run, each its own LoRA adapter, seed, data and hyper-parameters.

``+tenants=8`` gives 8 tenants that differ only in seed (``seed + i``); ``+tenants=[{lr:1e-3},{seed:7,rank:8}]``
gives one tenant per entry, each entry overriding the defaults for that tenant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from skyrl_clora.config.value_types import typed_value

PER_TENANT_SKYRL = {
    "temperature": "generator.sampling_params.temperature",
    "top_p": "generator.sampling_params.top_p",
    "weight_decay": "trainer.policy.optimizer_config.weight_decay",
    "max_grad_norm": "trainer.policy.optimizer_config.max_grad_norm",
    "kl_loss_coef": "trainer.algorithm.kl_loss_coef",
    "eps_clip_low": "trainer.algorithm.eps_clip_low",
    "eps_clip_high": "trainer.algorithm.eps_clip_high",
    "advantage_estimator": "trainer.algorithm.advantage_estimator",
    "policy_loss_type": "trainer.algorithm.policy_loss_type",
}
"""Overrides of SkyRL keys that only change the tenant's own sampling or update (None in a spec: the run's value;
backend=embedded only), with the key each overrides."""
ALGORITHM_OVERRIDES = tuple(name for name, key in PER_TENANT_SKYRL.items() if key.startswith("trainer.algorithm."))
OVERRIDABLE = ("name", "seed", "lr", "rank", "alpha", "task_variant", "samples_per_prompt", "env_class",
               *PER_TENANT_SKYRL)
_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a tenant name: one folder name, no path


@dataclass(frozen=True)
class TenantSpec:
    """One experiment. ``env_class=None`` uses the recipe's environment; a ``None`` of :data:`PER_TENANT_SKYRL`, the
    run's value of that SkyRL key."""

    name: str
    seed: int
    lr: float
    rank: int
    alpha: float
    task_variant: str
    samples_per_prompt: int
    env_class: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    kl_loss_coef: float | None = None
    eps_clip_low: float | None = None
    eps_clip_high: float | None = None
    advantage_estimator: str | None = None
    policy_loss_type: str | None = None

    def algorithm_overrides(self) -> dict[str, object]:
        """The tenant's ``trainer.algorithm`` keys that differ from the run's (``{key: value}``)."""
        return {name: getattr(self, name) for name in ALGORITHM_OVERRIDES if getattr(self, name) is not None}


def expand_tenants(
    value: Any, *, seed: int, lr: float, rank: int, alpha: float, task_variant: str, samples_per_prompt: int
) -> list[TenantSpec]:
    """Expands ``tenants`` (an int >= 1, or a non-empty list of override dicts) into specs.

    Raises ValueError with a one-line message for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ValueError(f"tenants={value!r} is malformed; use +tenants=N (N >= 1) or +tenants=[{{lr:1e-3}},{{seed:7}}]")
    overrides: list[dict[str, Any]] = [{} for _ in range(value)] if isinstance(value, int) else value
    if not overrides:
        raise ValueError(f"tenants={value!r}: need at least 1 tenant; use +tenants=N with N >= 1")
    specs = []
    hints = get_type_hints(TenantSpec)
    for index, override in enumerate(overrides):
        if not isinstance(override, dict):
            raise ValueError(f"tenant {index} override {override!r} is not a mapping; write e.g. {{lr:1e-3,rank:8}}")
        unknown = sorted(set(override) - set(OVERRIDABLE))
        if unknown:
            raise ValueError(_unknown_override(index, str(unknown[0])))
        defaults = {"name": f"tenant-{index}", "seed": seed + index, "lr": lr, "rank": rank, "alpha": alpha,
                    "task_variant": task_variant, "samples_per_prompt": samples_per_prompt, "env_class": None,
                    **dict.fromkeys(PER_TENANT_SKYRL)}
        spec = TenantSpec(**{field: typed_value(override.get(field, default), hints[field], f"tenant {index}: {field}")
                             for field, default in defaults.items()})
        if not _NAME.fullmatch(spec.name) or spec.name in (".", ".."):
            raise ValueError(f"tenant {index}: name={spec.name!r} must be letters, digits, '.', '_' or '-' (it names the "
                             "tenant's adapter folder and its adapter in the sampler)")
        for field in ("temperature", "weight_decay", "kl_loss_coef", "eps_clip_low", "eps_clip_high"):
            if getattr(spec, field) is not None and getattr(spec, field) < 0:
                raise ValueError(f"tenant {spec.name}: {field}={getattr(spec, field)} must be >= 0")
        if spec.top_p is not None and not 0 < spec.top_p <= 1:
            raise ValueError(f"tenant {spec.name}: top_p={spec.top_p} must be in (0, 1]")
        if spec.max_grad_norm is not None and spec.max_grad_norm <= 0:
            raise ValueError(f"tenant {spec.name}: max_grad_norm={spec.max_grad_norm} must be positive")
        for field, key in (("rank", "trainer.policy.model.lora.rank"), ("lr", "trainer.policy.optimizer_config.lr"),
                           ("alpha", "trainer.policy.model.lora.alpha"),
                           ("samples_per_prompt", "generator.n_samples_per_prompt")):
            if not getattr(spec, field) > 0:
                raise ValueError(f"tenant {spec.name}: {field}={getattr(spec, field)} must be positive; set {key} or "
                                 f"the tenant's {field} override")
        specs.append(spec)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"tenant names must be unique, got {names}")
    return specs


def _unknown_override(index: int, key: str) -> str:
    """The one-line refusal of tenant ``index``'s override ``key``: a SkyRL key shared by the run's tenants is set
    for the run; anything else lists the overrides there are."""
    from skyrl.train.config import AlgorithmConfig

    name = key.rsplit(".", 1)[-1]
    if name in {f.name for f in fields(AlgorithmConfig)} or "." in key:
        where = f"trainer.algorithm.{name}" if "." not in key else key
        return (f"tenant {index}: {key} is not a per-tenant override (every tenant of the run shares it); set {where} "
                f"for the run, or use one of the per-tenant overrides: {', '.join(OVERRIDABLE)}")
    return f"tenant {index}: unknown override {key!r}; allowed: {', '.join(OVERRIDABLE)}"
