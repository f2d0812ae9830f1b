"""Real Tinker server processes on free ports, each with the test double of ``plumbing_backend`` as its backend,
shared by the tests of tests/tinker/ that drive them over HTTP or with the tinker SDK:

- ``tinker_server``: ``python -m skyrl_clora.tinker.server`` (the installed SkyRL with this project's additions);
- ``patched_skyrl_server``: SkyRL's own ``python -m skyrl.tinker.api`` from a copy of the installed ``skyrl`` with
  ``integration/patches/0007-tinker-pluggable-backends.patch`` applied (no API key: the patch adds none).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import skyrl

ROOT = Path(__file__).resolve().parents[2]
KEY = "tml-plumbing-tests-key"
PLUMBING_BACKEND = "tests.tinker.plumbing_backend:plumbing_backend"
TINKER_PATCH = ROOT / "integration" / "patches" / "0007-tinker-pluggable-backends.patch"
START_TIMEOUT_S = 300.0  # a generous bound on a server's start (imports on a busy 2-core machine); not a timing


@dataclass
class TinkerServer:
    url: str
    key: str
    base_model: str
    log: Path


def fake_model_folder(folder: Path) -> Path:
    """A folder the server accepts as ``--base-model`` (a ``config.json``); the plumbing backend reads nothing."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def server_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "skyrl_clora.tinker.server", *args]


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    folder = tmp_path_factory.mktemp("tinker_server")
    model, port = fake_model_folder(folder / "model"), _free_port()
    command = server_command("--base-model", str(model), "--backend", PLUMBING_BACKEND, "--port", str(port),
                             "--workdir", str(folder / "work"), "--api-key", KEY)
    yield from _serve(command, {}, TinkerServer(f"http://127.0.0.1:{port}", KEY, str(model.resolve()),
                                                 folder / "server.log"))


@pytest.fixture(scope="session")
def patched_skyrl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    folder = tmp_path_factory.mktemp("patched_skyrl_server")
    checkout = folder / "checkout"
    shutil.copytree(Path(skyrl.__file__).resolve().parent, checkout / "skyrl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "apply", str(TINKER_PATCH)], cwd=checkout, check=True,
                   env={**os.environ, "GIT_CEILING_DIRECTORIES": str(folder)})
    model, port = fake_model_folder(folder / "model"), _free_port()
    command = [sys.executable, "-m", "skyrl.tinker.api", "--base-model", str(model), "--backend", PLUMBING_BACKEND,
               "--host", "127.0.0.1", "--port", str(port), "--database-url", f"sqlite:///{folder / 'tinker.db'}",
               "--checkpoints-base", str(folder / "checkpoints")]
    yield from _serve(command, {"PYTHONPATH": os.pathsep.join([str(checkout), str(ROOT)])},
                      TinkerServer(f"http://127.0.0.1:{port}", KEY, str(model), folder / "server.log"))


def _serve(command: list[str], env: dict[str, str], server: TinkerServer) -> Iterator[TinkerServer]:
    """Runs ``command`` (from the repository's root, ``env`` added) until the caller is done with ``server``, once
    its healthz answers; its output goes to ``server.log``."""
    with open(server.log, "w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "TINKER_TELEMETRY": "0", **env},
                                   stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(server.url):
            assert process.poll() is None, f"the server exited ({process.returncode}): {server.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not answer healthz: {server.log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def clora_server(micro_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    """``python -m skyrl_clora.tinker.server`` with the ``clora`` backend on the micro model, on the CPU."""
    yield from serve_clora(micro_model_dir, tmp_path_factory.mktemp("clora_server"))


@pytest.fixture(scope="session")
def learning_clora_server(learning_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    """The same on the micro model made learnable on the micro task (``learning_model_dir``), its sequences as long as
    the task's prompts need."""
    yield from serve_clora(learning_model_dir, tmp_path_factory.mktemp("learning_clora_server"), 512)


def serve_clora(model: Path, folder: Path, max_sequence_length: int = 128) -> Iterator[TinkerServer]:
    """``python -m skyrl_clora.tinker.server`` with the ``clora`` backend on ``model`` (CPU; work folder ``folder``),
    until the caller is done with it."""
    port = _free_port()
    config = {"max_lora_adapters": 8, "max_lora_rank": 8, "max_rows": 32, "max_sequence_length": max_sequence_length,
              "overrides": ["clora.device=cpu"]}
    command = server_command("--base-model", str(model), "--port", str(port), "--workdir", str(folder),
                             "--api-key", KEY, "--backend-config", json.dumps(config))
    yield from _serve(command, {"OMP_NUM_THREADS": "1"}, TinkerServer(f"http://127.0.0.1:{port}", KEY, str(model),
                                                                     folder / "server.log"))
