"""Per-tenant checkpoints and resume, in SkyRL's vocabulary (``trainer.ckpt_interval``, ``ckpt_path``,
``max_ckpts_to_keep``, ``resume_mode`` = latest | none | from_path, ``resume_path``).

Layout: ``<ckpt_path>/<tenant>/global_step_<k>/`` holds what the backend saves of the tenant (its adapter in
PEFT format, fp32 masters, Adam moments, gradients, optimizer step, RNG state) and ``tenant.json`` (the RL steps
done, the published adapter version, whether the tenant finished, its metrics records so far, and the run's
identity); ``<ckpt_path>/<tenant>/latest_ckpt_global_step.txt`` names the newest one. A checkpoint is written
into a temporary folder and renamed into place, and the pointer file is replaced after it, so a kill at any
moment leaves the previous checkpoint complete and named. The data cursor is the step count (a tenant's rows of
step k are a function of its seed and k), and the sampling seeds are functions of the tenant, step and episode,
so a resumed tenant continues exactly as it would have.

The output folder belongs to one run: ``<output_dir>/run_config.json`` records the run's identity (every key
that changes results). A second run into the folder with the same identity resumes it (``resume_mode=latest``),
with another identity it is refused with the differing keys; ``resume_mode=none`` into a folder that holds a run
is refused too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from skyrl_clora.config.schema import ConfigError, RunConfig
from skyrl_clora.tenants import TenantSpec

LATEST = "latest_ckpt_global_step.txt"
TENANT_META = "tenant.json"
RUN_IDENTITY = "run_config.json"


@dataclass(frozen=True)
class TenantCheckpoint:
    """A tenant's newest complete checkpoint: ``folder`` (what the backend saved), the RL ``step``s done, the
    published adapter ``version``, whether the tenant ``finished`` (final evaluation and export done) and its
    metrics ``records`` so far."""

    folder: Path
    step: int
    version: int
    finished: bool
    records: list[dict[str, Any]]


def checkpoint_root(run: RunConfig) -> Path:
    """``trainer.ckpt_path``, or ``<output_dir>/checkpoints``."""
    path = run.trainer.ckpt_path
    return Path(os.path.expanduser(path)) if path is not None else run.output_dir / "checkpoints"


class TenantCheckpoints:
    """One tenant's checkpoint folder under ``root``: atomic writes, the newest, pruning to ``keep`` (-1: all)."""

    def __init__(self, root: Path, tenant: str, keep: int) -> None:
        self.folder = root / tenant
        self.keep = keep

    async def write(self, step: int, version: int, finished: bool, records: list[dict[str, Any]],
                    identity: dict[str, Any], save: Callable[[Path], Awaitable[None]]) -> Path:
        """Writes ``global_step_<step>``: ``save(folder)`` fills it with the backend's state, then the tenant's
        metadata; renames it into place, points ``latest`` at it and prunes old ones."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"global_step_{step}"
        temporary = self.folder / f".tmp-global_step_{step}-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        await save(temporary)
        meta = {"step": step, "version": version, "finished": finished, "records": records, "identity": identity}
        _write_synced(temporary / TENANT_META, json.dumps(meta, sort_keys=True))
        _sync_folder(temporary)
        if final.exists():  # a checkpoint of this step from before a resume: the new one replaces it
            shutil.rmtree(final)
        temporary.rename(final)
        _write_synced(self.folder / f".{LATEST}.tmp", str(step))
        os.replace(self.folder / f".{LATEST}.tmp", self.folder / LATEST)
        _sync_folder(self.folder)
        self._prune(step)
        return final

    def latest(self) -> TenantCheckpoint | None:
        """The newest complete checkpoint, or None when there is none."""
        meta = self._newest_meta()
        if meta is None:
            return None
        folder, data = meta
        return TenantCheckpoint(folder, data["step"], data["version"], data["finished"], data["records"])

    def at_most(self, step: int) -> TenantCheckpoint | None:
        """The newest complete checkpoint of at most ``step`` RL steps, or None."""
        for held in self._steps():
            meta = self.folder / f"global_step_{held}" / TENANT_META
            if held <= step and meta.is_file():
                data = json.loads(meta.read_text())
                return TenantCheckpoint(meta.parent, data["step"], data["version"], data["finished"], data["records"])
        return None

    def identity(self) -> dict[str, Any] | None:
        """The run identity the newest checkpoint was written under, or None when there is none."""
        meta = self._newest_meta()
        return None if meta is None else meta[1]["identity"]

    def _newest_meta(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete checkpoint folder and its metadata: the one the pointer names, else (a kill while
        a checkpoint of the same step was replaced) the newest folder whose metadata was written."""
        pointer = self.folder / LATEST
        steps = self._steps()
        if pointer.is_file():
            steps.insert(0, int(pointer.read_text()))
        for step in steps:
            meta = self.folder / f"global_step_{step}" / TENANT_META
            if meta.is_file():
                return meta.parent, json.loads(meta.read_text())
        return None

    def _prune(self, newest: int) -> None:
        for stale in self.folder.glob(".tmp-global_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep < 0:
            return
        for step in [s for s in self._steps() if s != newest][self.keep - 1:]:
            shutil.rmtree(self.folder / f"global_step_{step}", ignore_errors=True)

    def _steps(self) -> list[int]:
        """The steps of the ``global_step_<k>`` folders here, newest first."""
        return sorted((int(p.name.removeprefix("global_step_")) for p in self.folder.glob("global_step_*")),
                      reverse=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _sync_folder(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def export_finished(run: RunConfig, resume: dict[str, TenantCheckpoint]) -> None:
    """Copies the adapter of every finished tenant in ``resume`` from its checkpoint to
    ``<output_dir>/adapters/<tenant>`` where it is not there (a run continued in another folder)."""
    for name, checkpoint in resume.items():
        target = run.output_dir / "adapters" / name
        if checkpoint.finished and not target.exists():
            shutil.copytree(checkpoint.folder / "adapter", target)


def resumed_records(resume: dict[str, TenantCheckpoint], specs: list[Any]) -> list[dict[str, Any]]:
    """The metrics records the checkpoints in ``resume`` carry, tenant by tenant in the order of ``specs``."""
    return [record for spec in specs if spec.name in resume for record in resume[spec.name].records]


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The keys whose values differ between two run identities (a key only one has counts)."""
    return sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))


LIVE_FILE = "live_tenants.json"


def read_live_tenants(output_dir: Path) -> tuple[list[TenantSpec], list[str]]:
    """The tenants added to the run in ``output_dir`` while it went, and the names of those stopped."""
    path = output_dir / LIVE_FILE
    if not path.is_file():
        return [], []
    state = json.loads(path.read_text())
    return [TenantSpec(**spec) for spec in state["added"]], list(state["stopped"])


def write_live_tenants(output_dir: Path, added: list[TenantSpec], stopped: list[str]) -> None:
    """Records (atomically) the tenants added to the run in ``output_dir`` and the names of those stopped."""
    temporary = output_dir / f".{LIVE_FILE}.tmp"
    temporary.write_text(json.dumps({"added": [asdict(spec) for spec in added], "stopped": stopped}, indent=1) + "\n")
    temporary.replace(output_dir / LIVE_FILE)


def run_tenants(run: RunConfig) -> list[TenantSpec]:
    """The run's tenants: those it started with, then those added while it went (``live_tenants.json``)."""
    names = {spec.name for spec in run.tenants}
    return [*run.tenants, *(spec for spec in read_live_tenants(run.output_dir)[0] if spec.name not in names)]


def claim_output_dir(run: RunConfig) -> tuple[RunConfig, dict[str, TenantCheckpoint], list[str]]:
    """Makes ``run.output_dir`` this run's and returns the run with the tenants added to it while it went (when
    it resumes one), the checkpoints to resume from by tenant (a tenant without one starts afresh) and the tenants
    stopped through the control endpoint (they stay stopped). Refuses (:class:`ConfigError`, nothing changed) a
    folder holding a run of another identity, ``resume_mode=none`` into a folder holding a run, and
    ``from_path`` checkpoints of another identity."""
    record = run.output_dir / RUN_IDENTITY
    held = json.loads(record.read_text()) if record.is_file() else None
    if held is not None and run.trainer.resume_mode == "none":
        raise ConfigError(f"clora.output_dir={run.output_dir} holds a run; resume it (trainer.resume_mode=latest) or "
                          "choose a new clora.output_dir")
    if held is not None and held != run.identity:
        raise ConfigError(f"clora.output_dir={run.output_dir} holds a run whose config differs in "
                          f"{', '.join(differing_keys(held, run.identity))}; choose a new clora.output_dir, or "
                          "repeat that run's config to resume it")
    if run.trainer.resume_mode == "from_path":
        root = Path(os.path.expanduser(run.trainer.resume_path))
        for spec in run.tenants:
            saved = TenantCheckpoints(root, spec.name, -1).identity()
            if saved is not None and saved != run.identity:
                raise ConfigError(f"trainer.resume_path={root}: tenant {spec.name}'s checkpoints were written by a run "
                                  f"whose config differs in {', '.join(differing_keys(saved, run.identity))}")
    else:
        root = checkpoint_root(run) if held is not None else None
    added, stopped = read_live_tenants(run.output_dir) if held is not None else ([], [])
    run = replace(run, tenants=(*run.tenants, *added))
    checkpoints = {}
    if root is not None:
        for spec in run.tenants:
            latest = TenantCheckpoints(root, spec.name, -1).latest()
            if latest is not None:
                checkpoints[spec.name] = latest
    if run.trainer.pack_policy == "lockstep":
        checkpoints = _common_step(root, run, checkpoints, stopped)
    prepare_output_dir(run.output_dir)
    record.write_text(json.dumps(run.identity, indent=1, sort_keys=True) + "\n")
    return run, checkpoints, stopped


def output_entries(path: Path) -> frozenset[str] | None:
    """The names in ``path`` (None when there is no such folder): taken before :func:`claim_output_dir`, so that
    :func:`release_refused_claim` knows what the command wrote."""
    return frozenset(os.listdir(path)) if path.is_dir() else None


def release_refused_claim(path: Path, before: frozenset[str] | None) -> None:
    """Undoes this command's claim of ``path`` when its run is refused after the claim (e.g. by the memory plan):
    removes every entry the command wrote there (those not in ``before``, :func:`output_entries`) and the folder
    itself when the command made it. A folder that held a run before (it was being resumed) is left as it is."""
    if before is not None and RUN_IDENTITY in before:
        return
    if before is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in set(os.listdir(path)) - before:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _common_step(root: Path | None, run: RunConfig, checkpoints: dict[str, TenantCheckpoint],
                 stopped: list[str]) -> dict[str, TenantCheckpoint]:
    """Lockstep packing (``clora.pack_policy=lockstep``): every tenant not stopped resumes from the newest step all
    of them hold a checkpoint of (a kill between two tenants' checkpoints of one round leaves some a round
    ahead), so that the resumed rounds pack as the uninterrupted ones did. None held by all: all start afresh."""
    tenants = [spec.name for spec in run.tenants if spec.name not in stopped]
    common = min((checkpoints[name].step if name in checkpoints else 0) for name in tenants) if tenants else 0
    rolled = {name: checkpoint for name, checkpoint in checkpoints.items() if name in stopped}
    for name in tenants:
        if common == 0:
            continue
        held = checkpoints[name] if checkpoints[name].step == common else \
            TenantCheckpoints(root, name, -1).at_most(common)
        if held is None or held.step != common:
            raise ConfigError(f"tenant {name} keeps no checkpoint of step {common}, the newest step every tenant of this "
                              "lockstep run holds, so the run cannot resume as it went: start it in a new "
                              "clora.output_dir (with trainer.max_ckpts_to_keep >= 2)")
        rolled[name] = held
    return rolled


def prepare_output_dir(path: Path) -> None:
    """Creates ``path`` (a run's ``clora.output_dir``, claimed after every refusal) if missing; a :class:`ConfigError`
    when it cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(f"clora.output_dir={path} is not writable ({error.strerror}); choose another directory") from None
