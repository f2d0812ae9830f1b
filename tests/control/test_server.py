"""The control endpoint's token: every route refuses a request without it (status 401, nothing changed), works with
it, and ``python -m skyrl_clora.ctl`` reads it from the run's folder. The endpoint serves a stand-in of the run's
tenants (what :class:`~skyrl_clora.control.server.ControlledTenants` asks of a pool); the end-to-end runs with ``ctl`` are
in test_checkpoints.py and placement/test_replicas.py."""

from __future__ import annotations

import asyncio
import json
import stat
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.helpers import http_call
from tests.support.micro_task import micro_tenants, run_args
from skyrl_clora import ctl
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.control.server import CONTROL_FILE, ControlServer
from skyrl_clora.config.compose import compose_config
from skyrl_clora.recipes.plugin import TaskSource
from skyrl_clora.tenants import TenantSpec

ADDED = {"name": "c", "env_class": "micro_letters"}
# Every route of the endpoint (method, pattern) with a request it accepts (path, body), in an order in which each is
# accepted.
ROUTES = [("GET", "/tenants", "/tenants", None), ("POST", "/tenants", "/tenants", ADDED),
          ("POST", "/tenants/{name}/stop", "/tenants/a/stop", None)]
WRONG = {"no header": None, "a wrong token": "Bearer wrong", "another scheme": "Basic {token}",
         "the token and more": "Bearer {token}x", "a non-ASCII token": "Bearer \u00e9", "no token": "Bearer "}


class StandInTenants:
    """Running tenants with their steps done: ``add`` starts one, ``stop`` ends one at once."""

    def __init__(self, names: list[str]) -> None:
        self.running = dict.fromkeys(names, 1)

    async def add(self, spec: TenantSpec, source: TaskSource) -> None:
        self.running[spec.name] = 0

    def stop(self, name: str) -> None:
        if name not in self.running:
            raise ConfigError(f"tenant {name} is not running here")
        del self.running[name]

    async def steps_done(self) -> dict[str, int]:
        return dict(self.running)


class Endpoint:
    """A :class:`ControlServer` over :class:`StandInTenants` a and b, served on an event loop in a thread."""

    def __init__(self, model_dir: Path, out: Path) -> None:
        self.out = out
        cfg = compose_config(run_args(model_dir, out, micro_tenants({"name": "a"}, {"name": "b"})))
        run = plan_steps(build_run_config(cfg), train_rows=12)
        self.tenants = StandInTenants(["a", "b"])
        self.server = ControlServer(run, self.tenants, ["a", "b"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result()
        self.token = json.loads((out / CONTROL_FILE).read_text())["token"]

    def call(self, method: str, path: str, body: Any = None, authorization: str | None = None) -> tuple[int, Any]:
        return http_call(self.url + path, method, body, authorization)

    def state(self) -> tuple:
        """What a request could change: the running tenants, the run's names, the live-tenant record."""
        live = self.out / "live_tenants.json"
        return dict(self.tenants.running), list(self.server.known), live.read_text() if live.exists() else None

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture
def endpoint(micro_model_dir: Path, tmp_path: Path) -> Iterator[Endpoint]:
    served = Endpoint(micro_model_dir, tmp_path)
    yield served
    served.close()


def test_every_route_is_tested(endpoint: Endpoint) -> None:
    routes = {(route.method, route.resource.canonical) for route in endpoint.server.app("token").router.routes()}
    assert routes - {("HEAD", "/tenants")} == {(method, pattern) for method, pattern, _, _ in ROUTES}


def test_control_json_holds_url_and_token_readable_by_its_owner_only(micro_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / CONTROL_FILE).write_text("{}")  # a world-readable leftover of an earlier run is replaced
    (tmp_path / CONTROL_FILE).chmod(0o644)
    served = Endpoint(micro_model_dir, tmp_path)
    try:
        control = tmp_path / CONTROL_FILE
        assert stat.S_IMODE(control.stat().st_mode) == 0o600
        written = json.loads(control.read_text())
        assert written == {"url": served.url, "token": served.token} and len(served.token) >= 40
        assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []  # no temporary left
    finally:
        served.close()
    assert not (tmp_path / CONTROL_FILE).exists()
    again = Endpoint(micro_model_dir, tmp_path)  # a new token per start
    try:
        assert again.token != served.token
        assert again.call("GET", "/tenants", authorization=f"Bearer {served.token}")[0] == 401
    finally:
        again.close()


@pytest.mark.parametrize("wrong", WRONG.values(), ids=WRONG.keys())
def test_every_route_refuses_a_request_without_the_token_and_changes_nothing(endpoint: Endpoint,
                                                                              wrong: str | None) -> None:
    before = endpoint.state()
    header = None if wrong is None else wrong.format(token=endpoint.token)
    requests = [(method, path, body) for method, _, path, body in ROUTES]
    for method, path, body in [*requests, ("HEAD", "/tenants", None), ("GET", "/no/such/route", None)]:
        status, answer = endpoint.call(method, path, body, header)
        assert status == 401, (method, path, status, answer)
        if method != "HEAD":
            assert answer.keys() == {"error"} and "\n" not in answer["error"]
            assert answer["error"].startswith("missing or wrong token: send the header 'Authorization: Bearer <token>'")
            assert str(endpoint.out / CONTROL_FILE) in answer["error"]
    assert endpoint.state() == before  # b, a still running; c not added; nothing recorded


def test_every_route_works_with_the_token(endpoint: Endpoint) -> None:
    answers = [endpoint.call(method, path, body, f"bearer {endpoint.token}") for method, _, path, body in ROUTES]
    steps = endpoint.server.run.steps
    assert answers[0] == (200, {"running": [{"name": "a", "steps_done": 1, "steps": steps},
                                            {"name": "b", "steps_done": 1, "steps": steps}]})
    assert answers[1][0] == 200 and answers[1][1]["added"]["name"] == "c"
    assert answers[2] == (200, {"stopping": "a"})
    assert endpoint.tenants.running == {"b": 1, "c": 0}
    assert endpoint.call("GET", "/no/such/route", None, f"Bearer {endpoint.token}")[0] == 404


def test_ctl_reads_the_token_from_the_run_folder(endpoint: Endpoint, capsys: pytest.CaptureFixture) -> None:
    assert ctl.main(["--dir", str(endpoint.out), "list"]) == 0
    assert [row["name"] for row in json.loads(capsys.readouterr().out)["running"]] == ["a", "b"]
    assert ctl.main(["--dir", str(endpoint.out), "add", "{name: c, env_class: micro_letters}"]) == 0
    assert json.loads(capsys.readouterr().out)["added"]["name"] == "c"
    assert ctl.main(["--dir", str(endpoint.out), "stop", "b"]) == 0
    assert json.loads(capsys.readouterr().out) == {"stopping": "b"}
    assert endpoint.tenants.running == {"a": 1, "c": 0}
    control = endpoint.out / CONTROL_FILE
    control.write_text(json.dumps({"url": endpoint.url, "token": "stale"}))  # e.g. another start's token
    assert ctl.main(["--dir", str(endpoint.out), "stop", "a"]) == 2
    assert capsys.readouterr().err.startswith("error: missing or wrong token")
    assert endpoint.tenants.running == {"a": 1, "c": 0}


def test_ctl_says_in_one_line_when_it_cannot_read_control_json(endpoint: Endpoint, capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(path: Path, *args: Any, **kwargs: Any) -> str:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "read_text", unreadable)  # as for another user's run (root reads any file)
    assert ctl.main(["--dir", str(endpoint.out), "list"]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: cannot read {endpoint.out / CONTROL_FILE} (Permission denied); run ctl as the user who "
                   "started the run\n")
