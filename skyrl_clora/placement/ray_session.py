"""The Ray session of every Ray this package starts (a replicated run's, backend=skyrl's small local one) or that
SkyRL's ``initialize_ray`` starts for it: Ray's system config, SkyRL's loss and estimator registries (their named
actors, owned by the driver), and the ``cloudpickle`` those registries need."""

from __future__ import annotations

import importlib.util
import sys
from types import MappingProxyType
from typing import Any

import ray

RAY_SYSTEM_CONFIG = MappingProxyType({"worker_niceness": 0})
"""Ray's system config for every Ray this package starts (``ray.init(_system_config=...)``; SkyRL's ``initialize_ray``
gets it as ``RAY_worker_niceness``). Ray runs its workers at niceness 15 by default, for workers that are background
tasks beside the driver; here they are the run's own work (the replicas, SkyRL's trainer workers), and at niceness 15
any other busy process on the machine takes nearly all the CPU from them. Read-only: ``ray.init`` adds the session's
spilling settings to the dict it is given, so each start gets a copy (else the next start in this process would
inherit the last session's spill folder)."""


def forget_stale_registry_actors() -> None:
    """SkyRL's loss/estimator registries cache their Ray actor's handle per process and only drop it when no
    actor of that name exists; after a Ray restart in this process (tests, a second run) the new session's
    actor exists and the cached handle points into the old session. Drop the handles before Ray starts."""
    give_skyrl_cloudpickle()
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry

    for registry in (PolicyLossRegistry, AdvantageEstimatorRegistry):
        registry._ray_actor = None
        registry._synced_to_actor = False


def start_ray(**init_kwargs: Any) -> None:
    """Starts Ray in this process (none runs yet) with :data:`RAY_SYSTEM_CONFIG` and ``init_kwargs``
    (``ray.init``'s), the registries' handles from an earlier session dropped first."""
    forget_stale_registry_actors()
    ray.init(_system_config=dict(RAY_SYSTEM_CONFIG), **init_kwargs)


def sync_skyrl_registries() -> None:
    """Makes (or joins) the registries' named Ray actors from this driver, as SkyRL's ``initialize_ray`` does: made
    by a Ray worker they would die with it. Ray runs in this process."""
    give_skyrl_cloudpickle()
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

    sync_registries()


def give_skyrl_cloudpickle() -> None:
    """SkyRL 0.4's loss registries (``ppo_utils``) pickle functions for their Ray registry actors with
    ``cloudpickle``, falling back to plain ``pickle`` when that package is missing (it is not a dependency
    here). Plain pickle fails on them (in an actor, already while ``ppo_utils`` imports), so hand SkyRL the
    cloudpickle Ray ships, for imports to come and for a ``ppo_utils`` imported already."""
    if importlib.util.find_spec("cloudpickle") is not None:
        return
    sys.modules.setdefault("cloudpickle", ray.cloudpickle)
    ppo_utils = sys.modules.get("skyrl.backends.skyrl_train.utils.ppo_utils")
    if ppo_utils is not None:
        ppo_utils.cloudpickle = ray.cloudpickle
