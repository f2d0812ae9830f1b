"""Tenants: the RL experiments of one run, each its own LoRA adapter, seed, data and hyper-parameters.

``+tenants=8`` gives 8 tenants that differ only in seed (``seed + i``); ``+tenants=[{lr:1e-3},{seed:7,rank:8}]``
gives one tenant per entry, each entry overriding the defaults for that tenant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, get_type_hints

from skyrl_clora.value_types import typed_value

OVERRIDABLE = ("name", "seed", "lr", "rank", "alpha", "task_variant", "samples_per_prompt", "env_class")
_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a tenant name: one folder name, no path


@dataclass(frozen=True)
class TenantSpec:
    """One experiment. ``env_class=None`` uses the recipe's environment."""

    name: str
    seed: int
    lr: float
    rank: int
    alpha: float
    task_variant: str
    samples_per_prompt: int
    env_class: str | None = None


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
            raise ValueError(f"tenant {index}: unknown override {unknown[0]!r}; allowed: {', '.join(OVERRIDABLE)}")
        defaults = {"name": f"tenant-{index}", "seed": seed + index, "lr": lr, "rank": rank, "alpha": alpha,
                    "task_variant": task_variant, "samples_per_prompt": samples_per_prompt, "env_class": None}
        spec = TenantSpec(**{field: typed_value(override.get(field, default), hints[field], f"tenant {index}: {field}")
                             for field, default in defaults.items()})
        if not _NAME.fullmatch(spec.name) or spec.name in (".", ".."):
            raise ValueError(f"tenant {index}: name={spec.name!r} must be letters, digits, '.', '_' or '-' (it names the "
                             "tenant's adapter folder and its adapter in the sampler)")
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
