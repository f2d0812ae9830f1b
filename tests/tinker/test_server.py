"""skyrl_clora.tinker.server: the API key on every route but healthz (a real server, the real tinker SDK), the
refusals of bad input (one line, exit status 2, nothing started), the defaults and the engine's command."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tinker
from skyrl.tinker.config import EngineConfig, config_to_argv

import skyrl_clora.tiny_base
from skyrl_clora.tinker import server
from tests.tinker.conftest import ROOT, TinkerServer, fake_model_folder, server_command

WRONG = "tml-not-the-key"


def _routes(tinker_server: TinkerServer) -> list[tuple[str, str]]:
    """(method, path) of every route of the server's OpenAPI schema, path parameters filled in."""
    schema = httpx.get(f"{tinker_server.url}/openapi.json", headers={"X-API-Key": tinker_server.key}).json()
    return [(method.upper(), re.sub(r"\{[^}]+\}", "x", path)) for path, methods in schema["paths"].items()
            for method in methods]


def test_every_route_but_healthz_refuses_a_missing_or_wrong_key(tinker_server: TinkerServer) -> None:
    routes = _routes(tinker_server)
    assert ("POST", "/api/v1/asample") in routes and ("POST", "/api/v1/sessions/x/finish") in routes
    assert len(routes) >= 25
    refused = []
    for method, path in [*routes, ("GET", "/openapi.json"), ("GET", "/no/such/route")]:
        if path == "/api/v1/healthz":
            continue
        for headers in ({}, {"X-API-Key": WRONG}, {"Authorization": f"Bearer {tinker_server.key}"}):
            answer = httpx.request(method, tinker_server.url + path, headers=headers, json={})
            refused.append(answer.status_code == 401 and "X-API-Key" in answer.json()["detail"]
                           and "\n" not in answer.json()["detail"])
    assert all(refused) and len(refused) == 3 * (len(routes) + 1)
    assert httpx.get(f"{tinker_server.url}/api/v1/healthz").json() == {"status": "ok"}
    capabilities = httpx.get(f"{tinker_server.url}/api/v1/get_server_capabilities",
                             headers={"X-API-Key": tinker_server.key})
    assert capabilities.json() == {"supported_models": [{"model_name": tinker_server.base_model}]}


def test_the_sdk_with_a_wrong_key_is_refused(tinker_server: TinkerServer) -> None:
    service = tinker.ServiceClient(base_url=tinker_server.url, api_key=WRONG)  # connects at its first call
    with pytest.raises(tinker.AuthenticationError, match="missing or wrong API key"):
        service.create_lora_training_client(base_model=tinker_server.base_model, rank=4).result()


def _refusal(*args: str, env: dict[str, str] | None = None) -> str:
    """The one stderr line of the command ``args`` refused with exit status 2."""
    done = subprocess.run(server_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    return done.stderr


def test_a_key_without_the_tml_prefix_refuses_to_start(tmp_path: Path) -> None:
    model = str(fake_model_folder(tmp_path / "model"))
    assert "must start with 'tml-'" in _refusal("--api-key", "sk-123", "--base-model", model)
    assert "must start with 'tml-'" in _refusal("--base-model", model, env={server.API_KEY_ENV: "secret"})


def test_bad_input_is_refused_in_one_line(tmp_path: Path) -> None:
    assert "--no-such-option" in _refusal("--no-such-option")
    assert "--base-model" in _refusal("--api-key", "tml-k", "--base-model", str(tmp_path / "missing"), "--workdir",
                                      str(tmp_path))
    assert "--backend-config" in _refusal("--backend-config", "{not json")
    model = str(fake_model_folder(tmp_path / "model"))
    assert "--runtime-role" in _refusal("--api-key", "tml-k", "--base-model", model, "--workdir", str(tmp_path),
                                        "--runtime-role", "sometimes")


def test_the_key_is_given_taken_from_the_environment_or_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(server.API_KEY_ENV, raising=False)
    assert server.api_key("tml-given") == ("tml-given", False)
    first, drawn = server.api_key(None)
    assert drawn and re.fullmatch(r"tml-[0-9a-f]{64}", first) and server.api_key(None)[0] != first
    monkeypatch.setenv(server.API_KEY_ENV, "tml-from-env")
    assert server.api_key(None) == ("tml-from-env", False)
    with pytest.raises(server.BadInput):
        server.api_key("tml-")


def test_a_drawn_key_is_printed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    served = []
    monkeypatch.delenv(server.API_KEY_ENV, raising=False)
    monkeypatch.setattr(server, "serve", lambda config, key, host, port: served.append(key))
    model = str(fake_model_folder(tmp_path / "model"))
    assert server.main(["--base-model", model, "--workdir", str(tmp_path / "work")]) == 0
    assert len(served) == 1 and capsys.readouterr().err.count(served[0]) == 1


def _parsed(*args: str) -> argparse.Namespace:
    return server.parser().parse_args(list(args))


def test_defaults_live_in_the_work_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = fake_model_folder(tmp_path / "tiny")
    monkeypatch.setattr(skyrl_clora.tiny_base, "ensure_tiny_base", lambda cache_root, recipe: tiny)
    monkeypatch.setattr(skyrl_clora.tiny_base, "tiny_base_path", lambda cache_root, recipe: tiny)
    monkeypatch.delenv("SKYRL_DATABASE_URL", raising=False)
    work = tmp_path / "work"
    config = server.engine_config(_parsed("--workdir", str(work)))
    assert (config.base_model, config.backend) == (str(tiny), "clora")
    assert config.database_url == f"sqlite:///{work.resolve() / 'tinker.db'}"
    assert str(config.checkpoints_base) == str(work.resolve() / "checkpoints") and work.is_dir()
    monkeypatch.setenv("SKYRL_DATABASE_URL", "sqlite:////elsewhere.db")
    assert server.engine_config(_parsed("--workdir", str(work))).database_url == "sqlite:////elsewhere.db"
    given = server.engine_config(_parsed("--workdir", str(work), "--base-model", str(tiny), "--database-url",
                                         "sqlite:////given.db", "--checkpoints-base", "/ckpt", "--backend", "fsdp"))
    assert (given.database_url, str(given.checkpoints_base), given.backend) == ("sqlite:////given.db", "/ckpt", "fsdp")


def test_the_engine_starts_with_this_interpreter_through_engine_main(tmp_path: Path) -> None:
    config = EngineConfig(base_model=str(tmp_path), backend="clora", database_url="sqlite:////x.db")
    assert server.engine_command(["uv", "run", "python", "-m", "x"], config) == [
        sys.executable, "-m", "skyrl_clora.tinker.engine_main", *config_to_argv(config)]
