"""Bearer tokens for a run's HTTP endpoints (:mod:`skyrl_clora.control.auth`): fresh 256-bit tokens, the header that
carries one, a token file written owner-only from its creation on (replacing the old one whole), and the middleware
that answers a request without ``Bearer <token>`` with 401 and a one-line error before its handler runs."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from skyrl_clora.control.auth import Middleware, authorization, bearer_auth, new_token, write_private


def test_tokens_are_fresh_url_safe_256_bit_texts() -> None:
    tokens = {new_token() for _ in range(20)}
    assert len(tokens) == 20
    assert all(len(token) == 43 and all(c.isalnum() or c in "-_" for c in token) for token in tokens)
    assert authorization("abc") == {"Authorization": "Bearer abc"}


def test_a_private_file_is_its_owners_only_and_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    path.write_text("old, world-readable")
    path.chmod(0o644)
    (tmp_path / f".control.json.{os.getpid()}.tmp").write_text("left by a crashed write")
    write_private(path, '{"token": "t"}\n')
    assert path.read_text() == '{"token": "t"}\n' and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["control.json"], "no temporary file left"


def _answer(middleware: Middleware, header: str | None) -> tuple[web.StreamResponse, list[str]]:
    """``middleware``'s answer to ``GET /anything`` with ``header`` as its Authorization, and the handler's runs."""
    ran: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        ran.append(request.path)
        return web.json_response({"ok": True})

    headers = {} if header is None else {"Authorization": header}
    request = make_mocked_request("GET", "/anything", headers=headers)
    return asyncio.run(middleware(request, handler)), ran


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic secret-token", "Bearer secret-tokenx", "Bearer ",
                                    "Bearer \u00e9", "secret-token"])
def test_a_request_without_the_token_is_refused_before_its_handler(header: str | None) -> None:
    middleware = bearer_auth("secret-token", lambda message: {"error": message}, "see the run folder")
    response, ran = _answer(middleware, header)
    assert ran == [] and response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(response.body) == {"error": "missing or wrong token: send the header 'Authorization: Bearer "
                                                  "<token>' (see the run folder)"}


@pytest.mark.parametrize("header", ["Bearer secret-token", "bearer secret-token", "BEARER  secret-token "])
def test_a_request_with_the_token_reaches_its_handler(header: str) -> None:
    response, ran = _answer(bearer_auth("secret-token", lambda message: {"error": message}, "hint"), header)
    assert ran == ["/anything"] and response.status == 200
