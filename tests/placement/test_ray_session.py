"""skyrl_clora.placement.ray_session: SkyRL's loss registries get a ``cloudpickle`` that pickles functions (Ray's)
where the package is missing, and only then; the registries' cached actor handles are dropped before a new Ray
session; Ray starts with the package's system config, each start with a copy of its own (Ray itself is started by
the placement and backend tests marked ``ray``; here ``ray.init`` is stood in for)."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from typing import Any

import pytest
import ray
from skyrl.backends.skyrl_train.utils import ppo_utils
from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry

import skyrl_clora.placement.ray_session as ray_session


def test_without_cloudpickle_skyrl_gets_rays_which_pickles_a_local_function(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "cloudpickle" else find_spec(name, *args))
    monkeypatch.delitem(sys.modules, "cloudpickle", raising=False)
    monkeypatch.setattr(ppo_utils, "cloudpickle", pickle, raising=False)
    ray_session.give_skyrl_cloudpickle()
    assert sys.modules["cloudpickle"] is ray.cloudpickle
    assert ppo_utils.cloudpickle is ray.cloudpickle, "a ppo_utils imported already gets it too"

    def loss(x: int) -> int:
        return x + 1

    assert pickle.loads(ppo_utils.cloudpickle.dumps(loss))(1) == 2


def test_with_cloudpickle_installed_nothing_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())
    marker = object()
    monkeypatch.setattr(ppo_utils, "cloudpickle", marker, raising=False)
    ray_session.give_skyrl_cloudpickle()
    assert ppo_utils.cloudpickle is marker


def test_ray_starts_with_the_system_config_after_the_stale_handles_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    for registry in (PolicyLossRegistry, AdvantageEstimatorRegistry):
        monkeypatch.setattr(registry, "_ray_actor", "a handle from an earlier session")
        monkeypatch.setattr(registry, "_synced_to_actor", True)
    started: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> None:
        assert PolicyLossRegistry._ray_actor is None and AdvantageEstimatorRegistry._ray_actor is None
        assert not PolicyLossRegistry._synced_to_actor and not AdvantageEstimatorRegistry._synced_to_actor
        started.append(kwargs)

    monkeypatch.setattr(ray, "init", init)
    ray_session.start_ray(num_cpus=2)
    assert started == [{"_system_config": {"worker_niceness": 0}, "num_cpus": 2}]
    started[0]["_system_config"]["object_spilling_config"] = "this session's folder"  # as ray.init does
    ray_session.start_ray(num_cpus=2)
    assert started[1]["_system_config"] == {"worker_niceness": 0}, "a start inherits nothing from the last session"
