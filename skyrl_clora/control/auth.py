"""Bearer tokens for a run's HTTP endpoints: the control endpoint and the embedded SkyRL-protocol server.

Each endpoint draws its own token (:func:`new_token`) when it starts. :func:`bearer_auth` is an aiohttp middleware
that answers every request without ``Authorization: Bearer <token>`` (on any route, and on paths that match none)
with status 401 and a one-line error before any handler runs, so a refused request changes nothing.
:func:`write_private` writes the file that hands a token to its clients, readable by its owner only.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def new_token() -> str:
    """A fresh random token (URL-safe text, 256 bits)."""
    return secrets.token_urlsafe(32)


def authorization(token: str) -> dict[str, str]:
    """The request header that carries ``token``."""
    return {"Authorization": f"Bearer {token}"}


def write_private(path: Path, text: str) -> None:
    """Writes ``text`` to ``path``, mode 0600 from the file's creation on (never readable by others, not even while
    it is written): a new temporary file opened with that mode beside ``path``, renamed over ``path`` once written,
    so a reader sees the old file or the whole new one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def bearer_auth(token: str, error_body: Callable[[str], Any], hint: str) -> Middleware:
    """The middleware admitting only requests whose ``Authorization`` header is ``Bearer <token>`` (the scheme in
    any case; compared in constant time). Any other request is answered with status 401, a ``WWW-Authenticate:
    Bearer`` header and the JSON body ``error_body(message)`` (``message``: one line ending with ``hint``, where
    a client finds the token); the request's handler never runs."""
    expected = token.encode()
    message = f"missing or wrong token: send the header 'Authorization: Bearer <token>' ({hint})"

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "replace"), expected):
            return web.json_response(error_body(message), status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check
