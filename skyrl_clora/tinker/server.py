"""The Tinker API server on skyrl-clora: SkyRL 0.4's own server (``skyrl.tinker.api``) with the ``clora`` backend.

    python -m skyrl_clora.tinker.server [--base-model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
        [--workdir DIR] [--checkpoints-base DIR] [--database-url URL] [--backend clora] [--backend-config JSON]
        [every other flag of SkyRL's EngineConfig]

Defaults: the embedded tiny base model (built and cached on first use) as ``--base-model``; the ``clora`` backend;
the database ``<workdir>/tinker.db`` (or ``$SKYRL_DATABASE_URL``) and checkpoints under ``<workdir>/checkpoints``,
``--workdir`` being ``${SKYRL_CLORA_CACHE:-~/.cache/skyrl-clora}/tinker``.

What it adds to SkyRL's server:

- the engine subprocess is ``[sys.executable, "-m", "skyrl_clora.tinker.engine_main", *config_to_argv(config)]``
  (SkyRL's starts it through ``uv run`` with a ``uv`` extra per backend, which exist for SkyRL's own backends
  only); :mod:`skyrl_clora.tinker.engine_main` resolves the backend name;
- the routes the tinker SDK 0.38 needs (:mod:`skyrl_clora.tinker.compat`);
- an API key: every request but ``GET /api/v1/healthz`` must carry the header ``X-API-Key: <key>`` (what the SDK
  sends for its ``api_key`` / ``$TINKER_API_KEY``), compared in constant time; any other is answered 401 with a
  one-line JSON ``{"detail": ...}`` before any route runs (unknown paths included). The key is ``--api-key``, else
  ``$SKYRL_CLORA_TINKER_API_KEY``, else drawn at start (``tml-`` + 64 hex digits) and printed once on stderr. It
  must start with ``tml-``, the only prefix the SDK sends.

Exit status: 2 on bad input, reported as one ``error:`` line on stderr before anything starts; else 0 after SIGINT
(Ctrl-C) and 143 after SIGTERM (uvicorn raises the signal again once shut down, which kills the process), also when
the engine process died (SkyRL's server logs the engine's exit code, then stops itself with SIGTERM).
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
import sys
from pathlib import Path
from typing import Any, NoReturn

from pydantic import Field, ValidationError
from skyrl.tinker.config import EngineConfig, add_model, config_to_argv
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

API_KEY_ENV = "SKYRL_CLORA_TINKER_API_KEY"
KEY_PREFIX = "tml-"
OPEN_PATHS = frozenset({"/api/v1/healthz"})
ENGINE_MODULE = "skyrl_clora.tinker.engine_main"
PROG = "python -m skyrl_clora.tinker.server"


class BadInput(Exception):
    """Bad input to the command: its message is one line that names the fix."""


class CommandLine(EngineConfig):
    """SkyRL's EngineConfig with this command's defaults, for its flags (``add_model``): none is required, and the
    base model, database and checkpoints left out are resolved after parsing (:func:`engine_config`)."""

    base_model: str | None = Field(default=None, description="Base model folder (default: the embedded tiny base)",
                                   json_schema_extra={"argparse_type": str})
    backend: str = Field(default="clora", description="Backend: clora, <module>:<attribute>, or one of SkyRL's")
    checkpoints_base: str | None = Field(default=None, description="Checkpoint folder (default: <workdir>/checkpoints)",
                                         json_schema_extra={"argparse_type": str})
    database_url: str | None = Field(default=None, description="Database URL (default: $SKYRL_DATABASE_URL, else "
                                     "sqlite:///<workdir>/tinker.db)", json_schema_extra={"argparse_type": str})


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see {PROG} --help\n")


def parser() -> argparse.ArgumentParser:
    """The command line of the module docstring."""
    command = Parser(prog=PROG, description=__doc__.splitlines()[0])
    add_model(command, CommandLine)
    command.add_argument("--host", default="127.0.0.1", help="Host to bind to")
    command.add_argument("--port", type=int, default=8000, help="Port to bind to")
    command.add_argument("--api-key", default=None, help=f"The clients' API key (tml-...; default ${API_KEY_ENV}, "
                                                         "else drawn and printed on stderr)")
    command.add_argument("--workdir", type=Path, default=None,
                         help="Folder of the default database and checkpoints (default ~/.cache/skyrl-clora/tinker)")
    return command


def api_key(given: str | None) -> tuple[str, bool]:
    """The server's key and whether it was drawn here: ``given``, else ``$SKYRL_CLORA_TINKER_API_KEY``, else a new
    one. :class:`BadInput` for a key without the ``tml-`` prefix or with nothing after it."""
    key = given or os.environ.get(API_KEY_ENV)
    if key is None:
        return KEY_PREFIX + secrets.token_hex(32), True
    if not key.startswith(KEY_PREFIX) or len(key) == len(KEY_PREFIX):
        raise BadInput(f"the API key must start with '{KEY_PREFIX}' and go on after it (the tinker SDK refuses other "
                       f"keys); pass e.g. --api-key {KEY_PREFIX}<your secret>, or leave it out to have one drawn")
    return key, False


def base_model_folder(path: str | None) -> str:
    """``path`` when it is a readable model folder (a ``config.json`` in it); without ``path`` the embedded tiny
    base's folder, pre-trained first if it is not cached yet. :class:`BadInput` for an unusable ``path``."""
    if path is None:
        from skyrl_clora.tiny_base import TinyBaseRecipe, ensure_tiny_base, tiny_base_path

        recipe = TinyBaseRecipe(corpus="gsm8k")
        if not tiny_base_path(None, recipe).is_dir():
            print(f"[setup] pre-training the tiny base model into {tiny_base_path(None, recipe)} (first use only; "
                  "about 5 minutes on 2 CPU cores)", file=sys.stderr, flush=True)
        return str(ensure_tiny_base(None, recipe))
    config = Path(path) / "config.json"
    if not (config.is_file() and os.access(config, os.R_OK)):
        raise BadInput(f"--base-model {path} is not a readable model folder (no readable config.json in it); pass a "
                       "Hugging Face checkpoint folder, or leave --base-model out for the embedded tiny base")
    return str(Path(path).resolve())


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration of the parsed command line ``args`` (defaults of the module docstring; the work
    folder made). :class:`BadInput` for an unusable value, before anything is made when ``--base-model`` is one."""
    given_model = base_model_folder(args.base_model) if args.base_model is not None else None
    workdir = args.workdir
    if workdir is None:
        from skyrl_clora.tiny_base.pretrain import default_cache_root

        workdir = default_cache_root() / "tinker"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BadInput(f"cannot make the work folder {workdir} ({error.strerror}); pass a writable --workdir") from None
    fields = {name: value for name, value in vars(args).items() if name in EngineConfig.model_fields}
    fields["base_model"] = given_model or "<the tiny base>"  # built only once the rest is valid: it can take minutes
    fields["database_url"] = (args.database_url or os.environ.get("SKYRL_DATABASE_URL")
                              or f"sqlite:///{workdir.resolve() / 'tinker.db'}")
    fields["checkpoints_base"] = args.checkpoints_base or str(workdir.resolve() / "checkpoints")
    try:
        config = EngineConfig.model_validate(fields)
    except ValidationError as error:
        problem = error.errors()[0]
        flag = "--" + str(problem["loc"][0]).replace("_", "-")
        raise BadInput(f"{flag}: {problem['msg']}; see {PROG} --help") from None
    return config if given_model else config.model_copy(update={"base_model": base_model_folder(None)})


def engine_command(parent_cmd: list[str], config: EngineConfig) -> list[str]:
    """The engine subprocess's command (module docstring); in place of SkyRL's ``_build_uv_run_cmd_engine``, whose
    signature it keeps (``parent_cmd``, the API process's parent's command line, is not read)."""
    return [sys.executable, "-m", ENGINE_MODULE, *config_to_argv(config)]


class ApiKeyMiddleware:
    """ASGI middleware: an HTTP request to a path outside :data:`OPEN_PATHS` without the header ``X-API-Key: <key>``
    is answered 401 with a one-line JSON ``{"detail": ...}``, and the app never sees it; anything else passes."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("x-api-key", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, self.key):
                detail = (f"missing or wrong API key: send the header 'X-API-Key: <key>' (the tinker SDK's api_key or "
                          f"$TINKER_API_KEY), the key given to the server (--api-key or ${API_KEY_ENV}) or printed "
                          "by it at start")
                await JSONResponse({"detail": detail}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def serve(config: EngineConfig, key: str, host: str, port: int) -> None:
    """Serves SkyRL's Tinker API with this module's additions until SIGINT / SIGTERM (module docstring)."""
    import skyrl.tinker.api as api
    import uvicorn
    from skyrl.env_vars import SKYRL_HTTP_CONNECTION_LIMIT
    from skyrl.utils.log import get_uvicorn_log_config

    from skyrl_clora.tinker import compat

    api._build_uv_run_cmd_engine = engine_command
    compat.install(api.app)
    api.app.add_middleware(ApiKeyMiddleware, key=key)
    api.app.state.engine_config = config
    uvicorn.run(api.app, host=host, port=port, log_config=get_uvicorn_log_config(),
                backlog=SKYRL_HTTP_CONNECTION_LIMIT, timeout_keep_alive=api.HTTP_KEEP_ALIVE_TIMEOUT_SECONDS)


def host_for_clients(host: str) -> str:
    """The host a local client connects to for a server bound to ``host`` (a wildcard address: localhost)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def main(argv: list[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (module docstring)."""
    args = parser().parse_args(argv)
    try:
        key, drawn = api_key(args.api_key)
        config = engine_config(args)
    except BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if drawn:
        print(f"[tinker] API key (drawn for this run; clients pass it as api_key or $TINKER_API_KEY): {key}",
              file=sys.stderr, flush=True)
    print(f"[tinker] serving http://{host_for_clients(args.host)}:{args.port} (tinker.ServiceClient(base_url=..., "
          f"api_key=...)); base model {config.base_model}, backend {config.backend}", file=sys.stderr, flush=True)
    serve(config, key, args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
