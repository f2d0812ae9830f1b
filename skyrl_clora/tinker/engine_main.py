"""The Tinker engine process with skyrl-clora's backend: ``python -m skyrl_clora.tinker.engine_main <flags>``, the
flags being SkyRL's engine flags (:class:`skyrl.tinker.config.EngineConfig`, as ``config_to_argv`` writes them).

SkyRL 0.4's engine (:mod:`skyrl.tinker.engine`) builds its backend from ``get_backend_classes(name, use_ray)``, a
closed list (``jax``, ``fsdp``, ``megatron``). :func:`main` puts :func:`backend_classes` in its place in that module
and runs the engine's own ``main()``, so ``--backend`` takes:

- ``clora``: ``(CloraTinkerBackend, CloraTinkerConfig)`` of :mod:`skyrl_clora.tinker.backend`, imported only when
  asked for;
- ``<module>:<attribute>``: a backend of any importable module: the attribute, called without arguments, returns
  ``(backend class, config class)`` (the form ``integration/patches/0007-tinker-pluggable-backends.patch`` proposes
  to SkyRL);
- any other name: SkyRL's own resolver, its error for an unknown name included.

:mod:`skyrl_clora.tinker.server` starts this module as the engine subprocess of SkyRL's API server.

SkyRL's continuous sampler (a backend with ``sample_batch_async``) drains every running sample before any training
call, publish or model change, so that no sample runs while its backend sleeps or swaps engines. A backend whose class
sets ``samples_beside_blocking_ops = True`` (``clora``'s does) needs no such drain: :class:`BesideSampler` takes
SkyRL's sampler's place and drains only for other backends. ``integration/patches/0008`` proposes the same to SkyRL.

SkyRL's engine loop looks for new requests every 100 ms, each look about eight queries. :class:`PromptEngine`
looks every :data:`POLL_INTERVAL_S`, since each turn of a multi-turn episode is a request that waits for the next
look, but on a SQLite database only when some connection committed since its last look (:class:`DatabaseChanges`),
and at least every :data:`FULL_LOOK_S` (SkyRL's cadence) whatever the database says: a look holds the interpreter
lock that the engine's decode thread shares for its queries, a check for one ``PRAGMA``. Each look first reads which
request types are pending (one query) and skips SkyRL's queries for types that are not: during rollouts, when only
samples are pending, three queries a look instead of about eight. A request that arrives after that read waits for
the next look, which its commit brings.

SkyRL sets its logger to DEBUG and renders each record through rich, under the same lock; its engine logs a DEBUG
line per admission of samples. :func:`main` sets that logger to INFO.
"""

from __future__ import annotations

import importlib
import logging
import sqlite3
import time
from typing import Any

import skyrl.tinker.engine as skyrl_engine
from pydantic import BaseModel
from skyrl.backends.backend import AbstractBackend
from skyrl.tinker import types
from skyrl.tinker.db_models import FutureDB, RequestStatus
from sqlalchemy.engine import URL
from sqlmodel import Session, select

CLORA = "clora"
POLL_INTERVAL_S = 0.01  # the engine loop's sleep between checks for new requests (SkyRL's: 0.1)
FULL_LOOK_S = 0.1  # the engine loop looks for requests at least this often, changes or not
NOT_SINGLE = frozenset({types.RequestType.FORWARD_BACKWARD, types.RequestType.FORWARD, types.RequestType.SAMPLE,
                        types.RequestType.EXTERNAL})
"""The request types SkyRL's ``find_single_requests`` leaves out."""
SKYRL_BACKEND_CLASSES = skyrl_engine.get_backend_classes
"""SkyRL's own resolver, kept before :func:`main` replaces it."""


def backend_classes(backend_name: str, use_ray: bool = False) -> tuple[type[AbstractBackend], type[BaseModel]]:
    """``(backend class, config class)`` of ``backend_name`` (module docstring); ``use_ray`` goes to SkyRL's own
    resolver only. A ValueError names a name that resolves to nothing."""
    if backend_name == CLORA:
        from skyrl_clora.tinker.backend import CloraTinkerBackend, CloraTinkerConfig

        return CloraTinkerBackend, CloraTinkerConfig
    if ":" in backend_name:
        return plugin_backend_classes(backend_name)
    return SKYRL_BACKEND_CLASSES(backend_name, use_ray=use_ray)


def plugin_backend_classes(backend_name: str) -> tuple[type[AbstractBackend], type[BaseModel]]:
    """The classes a ``<module>:<attribute>`` backend name gives: ``attribute()`` of the imported ``module``, which
    must return an :class:`AbstractBackend` subclass and a pydantic model class. A ValueError says what is wrong."""
    module_name, _, attribute = backend_name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"backend {backend_name!r}: cannot load {attribute!r} from module {module_name!r} "
                         f"({error})") from error
    classes = factory()
    if not (isinstance(classes, tuple) and len(classes) == 2 and isinstance(classes[0], type)
            and issubclass(classes[0], AbstractBackend) and isinstance(classes[1], type)
            and issubclass(classes[1], BaseModel)):
        raise ValueError(f"backend {backend_name!r}: {attribute}() must return (an AbstractBackend subclass, a "
                         f"pydantic model class), not {classes!r}")
    return classes


class BesideSampler(skyrl_engine._ContinuousSampler):
    """SkyRL's continuous sampler whose :meth:`drain` does nothing when the engine's backend samples beside blocking
    operations (module docstring)."""

    def drain(self, reason: str) -> None:
        if not getattr(self._engine.backend, "samples_beside_blocking_ops", False):
            super().drain(reason)


class DatabaseChanges:
    """Whether a SQLite database file has had a commit (from any connection or process) since the last call, from
    SQLite's ``PRAGMA data_version`` on a connection of its own."""

    def __init__(self, path: str):
        self._connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._version: int | None = None

    @classmethod
    def of(cls, url: URL) -> DatabaseChanges | None:
        """The watcher of a SQLAlchemy database ``url``; None where it is not a SQLite file (every look then runs)."""
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return None
        return cls(url.database)

    def changed(self) -> bool:
        version = self._connection.execute("PRAGMA data_version").fetchone()[0]
        changed, self._version = version != self._version, version
        return changed


class PromptEngine(skyrl_engine.TinkerEngine):
    """SkyRL's engine checking for new requests every :data:`POLL_INTERVAL_S` and looking when the database changed
    or :data:`FULL_LOOK_S` passed, and skipping the finds of request types that are not pending (module docstring).
    The database version is read before each look, so a commit during a look (the engine's own results included)
    brings another."""

    _types_session: Session | None = None
    _types: frozenset[types.RequestType] = frozenset()

    def pending_types(self, session: Session) -> frozenset[types.RequestType]:
        """The types of the pending requests, read once per look (``session``: the look's session)."""
        if self._types_session is not session:
            query = select(FutureDB.request_type).where(FutureDB.status == RequestStatus.PENDING).distinct()
            self._types_session, self._types = session, frozenset(session.exec(query).all())
        return self._types

    def find_batchable_model_passes(self, session: Session, request_type: types.RequestType) -> dict[str, Any]:
        if request_type not in self.pending_types(session):
            return {}
        return super().find_batchable_model_passes(session, request_type)

    def find_batchable_sample(self, session: Session) -> dict[str, Any]:
        if types.RequestType.SAMPLE not in self.pending_types(session):
            return {}
        return super().find_batchable_sample(session)

    def find_single_requests(self, session: Session) -> dict[str, Any]:
        if not self.pending_types(session) - NOT_SINGLE:
            return {}
        return super().find_single_requests(session)

    def process_pending_requests(self) -> None:
        changes = DatabaseChanges.of(self.db_engine.url)
        last_look = -float("inf")
        while True:
            if changes is None or changes.changed() or time.monotonic() - last_look >= FULL_LOOK_S:
                last_look = time.monotonic()
                self.process_pending_requests_once()
            time.sleep(POLL_INTERVAL_S)


def main() -> None:
    """Runs SkyRL's Tinker engine (its command line, from ``sys.argv``) with :func:`backend_classes` as its
    resolver, :class:`BesideSampler` as its continuous sampler, :class:`PromptEngine` as its engine and SkyRL's logger
    at INFO."""
    logging.getLogger("skyrl").setLevel(logging.INFO)
    skyrl_engine.get_backend_classes = backend_classes
    skyrl_engine._ContinuousSampler = BesideSampler
    skyrl_engine.TinkerEngine = PromptEngine
    skyrl_engine.main()


if __name__ == "__main__":
    main()
