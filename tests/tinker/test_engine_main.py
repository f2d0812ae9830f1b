"""skyrl_clora.tinker.engine_main: the backend names it resolves (``clora``, ``<module>:<attribute>``, SkyRL's own),
that SkyRL's engine builds its backend through it, and that its continuous sampler drains only for backends that
cannot sample beside blocking operations."""

from __future__ import annotations

import logging
import random
import sqlite3
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import skyrl.tinker.engine as skyrl_engine
from pydantic import BaseModel
from skyrl.backends.backend import AbstractBackend
from skyrl.tinker import types as types_
from skyrl.tinker.config import EngineConfig
from skyrl.tinker.db_models import FutureDB, RequestStatus
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session, SQLModel, create_engine

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


def test_main_gives_skyrls_engine_the_beside_sampler_the_prompt_loop_and_an_info_logger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("get_backend_classes", "_ContinuousSampler", "TinkerEngine"):
        monkeypatch.setattr(skyrl_engine, name, getattr(skyrl_engine, name))  # restored after
    monkeypatch.setattr(skyrl_engine, "main", lambda: None)
    skyrl_logger = logging.getLogger("skyrl")
    monkeypatch.setattr(skyrl_logger, "level", logging.DEBUG)
    engine_main.main()
    assert skyrl_engine._ContinuousSampler is engine_main.BesideSampler
    assert skyrl_engine.TinkerEngine is engine_main.PromptEngine
    assert skyrl_logger.level == logging.INFO


def run_prompt_loop(url: str, checks: int, monkeypatch: pytest.MonkeyPatch,
                    on_look: Callable[[int], None] = lambda check: None,
                    on_sleep: Callable[[int], None] = lambda check: None) -> list[int]:
    """:meth:`PromptEngine.process_pending_requests` over a database ``url`` on a fake clock (poll 0.25 s, full look
    every 1 s) for ``checks`` checks, ``on_look(check)`` run in each look and ``on_sleep(check)`` in the sleep after
    each check; the checks that looked."""
    clock, looked = [0.0], []
    monkeypatch.setattr(engine_main, "POLL_INTERVAL_S", 0.25)
    monkeypatch.setattr(engine_main, "FULL_LOOK_S", 1.0)
    monkeypatch.setattr(engine_main.time, "monotonic", lambda: clock[0])

    def sleep(seconds: float) -> None:
        on_sleep(int(clock[0] / 0.25))
        clock[0] += seconds
        if clock[0] >= checks * 0.25:
            raise KeyboardInterrupt

    def once() -> None:
        looked.append(int(clock[0] / 0.25))
        on_look(looked[-1])

    monkeypatch.setattr(engine_main.time, "sleep", sleep)
    engine = types.SimpleNamespace(db_engine=types.SimpleNamespace(url=make_url(url)),
                                   process_pending_requests_once=once)
    with pytest.raises(KeyboardInterrupt):
        engine_main.PromptEngine.process_pending_requests(engine)
    return looked


def test_the_prompt_loop_looks_after_each_commit_and_every_full_look(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tinker.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("CREATE TABLE futures (request_id INTEGER)")

    def client_writes(check: int) -> None:  # a request arrives while the loop sleeps after checks 1 and 7
        if check in (1, 7):
            writer.execute("INSERT INTO futures VALUES (?)", (check,))

    def engine_writes(check: int) -> None:  # the look at check 8 writes a result: check 9 looks again
        if check == 8:
            writer.execute("UPDATE futures SET request_id = 0")

    looked = run_prompt_loop(f"sqlite:///{path}", 14, monkeypatch, engine_writes, client_writes)
    assert looked == [0, 2, 6, 8, 9, 13]
    assert engine_main.DatabaseChanges.of(make_url("sqlite://")) is None  # in memory: one database per connection


def test_the_prompt_loop_looks_at_every_check_without_sqlite(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_prompt_loop("postgresql://user@localhost/tinker", 5, monkeypatch) == [0, 1, 2, 3, 4]


PAYLOADS = {
    types_.RequestType.FORWARD_BACKWARD: {"data": [], "loss_fn": "cross_entropy"},
    types_.RequestType.FORWARD: {"data": [], "loss_fn": "cross_entropy"},
    types_.RequestType.SAMPLE: {"prompt": {"chunks": []}, "num_samples": 1, "checkpoint_id": "c",
                                "prompt_logprobs": False,
                                "sampling_params": {"temperature": 1.0, "max_tokens": 4, "seed": 0}},
}


def futures_database(path: Path, rows: list[tuple[types_.RequestType, str, RequestStatus]]) -> Engine:
    """A SkyRL database at ``path`` holding ``rows`` (type, model id, status) as futures, in request-id order."""
    database = create_engine(f"sqlite:///{path}")
    SQLModel.metadata.create_all(database)
    with Session(database) as session:
        for request_type, model_id, status in rows:
            session.add(FutureDB(request_type=request_type, model_id=model_id, status=status,
                                 request_data=PAYLOADS.get(request_type, {})))
        session.commit()
    return database


def bare_prompt_engine() -> engine_main.PromptEngine:
    """A :class:`PromptEngine` without SkyRL's start-up (no backend, no database): enough for its finds."""
    engine = object.__new__(engine_main.PromptEngine)
    engine.config = types.SimpleNamespace(backend="clora")
    return engine


def finds(engine: object, engine_class: type, database: Engine) -> tuple[dict, ...]:
    """The three finds of ``engine_class`` on ``engine`` in one session of ``database``, as ids -> model ids."""
    with Session(database) as session:
        found = (engine_class.find_batchable_model_passes(engine, session, types_.RequestType.FORWARD_BACKWARD),
                 engine_class.find_batchable_model_passes(engine, session, types_.RequestType.FORWARD),
                 engine_class.find_batchable_sample(engine, session),
                 engine_class.find_single_requests(engine, session))
    return tuple({request_id: entry[0] for request_id, entry in one.items()} for one in found)


def test_the_prompt_loops_finds_equal_skyrls_on_random_queues(tmp_path: Path) -> None:
    skyrls_engine = engine_main.PromptEngine.__bases__[0]
    engine = bare_prompt_engine()
    kinds = list(types_.RequestType)
    rng = random.Random(0)
    found_any = set()
    for case in range(60):
        rows = [(rng.choice(kinds), rng.choice("ab"), rng.choice([RequestStatus.PENDING, RequestStatus.COMPLETED]))
                for _ in range(rng.randint(0, 12))]
        database = futures_database(tmp_path / f"{case}.db", rows)
        ours, skyrls = finds(engine, engine_main.PromptEngine, database), finds(engine, skyrls_engine, database)
        assert ours == skyrls, rows
        found_any |= {index for index, one in enumerate(ours) if one}
    assert found_any == {0, 1, 2, 3}  # every find found requests in some case


def test_the_prompt_loop_reads_three_times_a_look_while_only_samples_are_pending(tmp_path: Path) -> None:
    rows = [(types_.RequestType.SAMPLE, "a", RequestStatus.PENDING), (types_.RequestType.OPTIM_STEP, "a",
                                                                      RequestStatus.COMPLETED)]
    database = futures_database(tmp_path / "tinker.db", rows)
    statements = []
    event.listen(database, "before_cursor_execute", lambda *args: statements.append(args[2]))
    engine = bare_prompt_engine()
    finds(engine, engine_main.PromptEngine.__bases__[0], database)
    skyrls = len(statements)
    statements.clear()
    assert finds(engine, engine_main.PromptEngine, database)[2] == {"1": "a"}
    assert len(statements) == 3 and skyrls >= 8, (statements, skyrls)
