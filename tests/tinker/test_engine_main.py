"""skyrl_clora.tinker.engine_main: the backend names it resolves (``clora``, ``<module>:<attribute>``, SkyRL's own),
that SkyRL's engine builds its backend through it, and that its continuous sampler drains only for backends that
cannot sample beside blocking operations."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import skyrl.tinker.engine as skyrl_engine
from pydantic import BaseModel
from skyrl.backends.backend import AbstractBackend
from skyrl.tinker.config import EngineConfig

from skyrl_clora.tinker import engine_main
from skyrl_clora.tinker.engine_main import backend_classes
from tests.tinker.conftest import PLUMBING_BACKEND, ROOT
from tests.tinker.plumbing_backend import PlumbingBackend, PlumbingConfig


def test_clora_is_imported_only_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    check = ("import sys, skyrl_clora.tinker.engine_main; "
             "assert 'skyrl_clora.tinker.backend' not in sys.modules, 'imported at once'")
    subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True, timeout=120)
    stand_in = types.ModuleType("skyrl_clora.tinker.backend")
    stand_in.CloraTinkerBackend, stand_in.CloraTinkerConfig = type("B", (), {}), type("C", (), {})
    monkeypatch.setitem(sys.modules, "skyrl_clora.tinker.backend", stand_in)
    assert backend_classes("clora") == (stand_in.CloraTinkerBackend, stand_in.CloraTinkerConfig)


def test_clora_is_the_projects_backend() -> None:
    from skyrl_clora.tinker.backend import CloraTinkerBackend, CloraTinkerConfig

    assert backend_classes("clora") == (CloraTinkerBackend, CloraTinkerConfig)
    assert issubclass(CloraTinkerBackend, AbstractBackend) and issubclass(CloraTinkerConfig, BaseModel)


def test_skyrls_own_names_still_resolve() -> None:
    from skyrl.backends.skyrl_train_backend import FSDPBackendOverrides, MegatronBackendOverrides, SkyRLTrainBackend

    assert backend_classes("fsdp") == (SkyRLTrainBackend, FSDPBackendOverrides)
    assert backend_classes("megatron") == (SkyRLTrainBackend, MegatronBackendOverrides)
    with pytest.raises(ValueError, match="Unknown backend: nope"):
        backend_classes("nope")


def test_a_module_attribute_name_resolves_a_plugin() -> None:
    assert backend_classes(PLUMBING_BACKEND) == (PlumbingBackend, PlumbingConfig)
    with pytest.raises(ValueError, match="cannot load 'x' from module 'no_such_module'"):
        backend_classes("no_such_module:x")
    with pytest.raises(ValueError, match="cannot load 'missing'"):
        backend_classes("tests.tinker.plumbing_backend:missing")
    with pytest.raises(ValueError, match=r"getcwd\(\) must return \(an AbstractBackend subclass"):
        backend_classes("os:getcwd")


def test_main_runs_skyrls_engine_with_this_resolver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(skyrl_engine, "get_backend_classes", skyrl_engine.get_backend_classes)  # restored after
    monkeypatch.setattr(skyrl_engine, "_ContinuousSampler", skyrl_engine._ContinuousSampler)
    config = EngineConfig(base_model=str(tmp_path), backend=PLUMBING_BACKEND,
                          database_url=f"sqlite:///{tmp_path / 'tinker.db'}")
    built = []
    monkeypatch.setattr(skyrl_engine, "main", lambda: built.append(skyrl_engine.TinkerEngine(config)))
    engine_main.main()
    assert skyrl_engine.get_backend_classes is backend_classes
    assert isinstance(built[0].backend, PlumbingBackend)


@pytest.mark.parametrize("beside", [True, False])
def test_the_sampler_drains_only_for_backends_that_cannot_sample_beside_blocking_ops(
        beside: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    drained: list[str] = []
    skyrls_sampler = engine_main.BesideSampler.__bases__[0]
    monkeypatch.setattr(skyrls_sampler, "drain", lambda self, reason: drained.append(reason))
    backend = types.SimpleNamespace(samples_beside_blocking_ops=True) if beside else types.SimpleNamespace()
    sampler = engine_main.BesideSampler(types.SimpleNamespace(backend=backend))
    sampler.drain("forward_backward")
    assert drained == ([] if beside else ["forward_backward"])


def test_main_gives_skyrls_engine_the_beside_sampler_and_the_prompt_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("get_backend_classes", "_ContinuousSampler", "TinkerEngine"):
        monkeypatch.setattr(skyrl_engine, name, getattr(skyrl_engine, name))  # restored after
    monkeypatch.setattr(skyrl_engine, "main", lambda: None)
    engine_main.main()
    assert skyrl_engine._ContinuousSampler is engine_main.BesideSampler
    assert skyrl_engine.TinkerEngine is engine_main.PromptEngine


def test_the_prompt_loop_looks_for_requests_every_poll_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    looks, sleeps = [], []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(engine_main.time, "sleep", sleep)
    engine = types.SimpleNamespace(process_pending_requests_once=lambda: looks.append(1))
    with pytest.raises(KeyboardInterrupt):
        engine_main.PromptEngine.process_pending_requests(engine)
    assert len(looks) == 3 and sleeps == [engine_main.POLL_INTERVAL_S] * 3
