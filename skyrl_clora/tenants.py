"""Tenants: the RL experiments of one run, each its own LoRA adapter, seed, data and hyper-parameters.

``+tenants=8`` gives 8 tenants that differ only in seed (``seed + i``); ``+tenants=[{lr:1e-3},{seed:7,rank:8}]``
gives one tenant per entry, each entry overriding the defaults for that tenant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OVERRIDABLE = ("name", "seed", "lr", "rank", "alpha", "task_variant", "samples_per_prompt", "env_class")


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
    for index, override in enumerate(overrides):
        if not isinstance(override, dict):
            raise ValueError(f"tenant {index} override {override!r} is not a mapping; write e.g. {{lr:1e-3,rank:8}}")
        unknown = sorted(set(override) - set(OVERRIDABLE))
        if unknown:
            raise ValueError(f"tenant {index}: unknown override {unknown[0]!r}; allowed: {', '.join(OVERRIDABLE)}")
        try:
            spec = TenantSpec(
                name=str(override.get("name", f"tenant-{index}")),
                seed=int(override.get("seed", seed + index)),
                lr=float(override.get("lr", lr)),
                rank=int(override.get("rank", rank)),
                alpha=float(override.get("alpha", alpha)),
                task_variant=str(override.get("task_variant", task_variant)),
                samples_per_prompt=int(override.get("samples_per_prompt", samples_per_prompt)),
                env_class=None if override.get("env_class") is None else str(override["env_class"]),
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"tenant {index}: bad override value ({error})") from None
        if spec.rank < 1 or spec.lr <= 0 or spec.samples_per_prompt < 1:
            raise ValueError(f"tenant {spec.name}: rank, lr and samples_per_prompt must be positive")
        specs.append(spec)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"tenant names must be unique, got {names}")
    return specs
