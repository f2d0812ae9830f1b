"""The embedded engine served over the HTTP protocol that SkyRL's ``RemoteInferenceClient`` speaks.

One :class:`~skyrl_clora.sampler.engine.Engine` sits behind a real aiohttp server bound to 127.0.0.1 on a
port chosen by the OS. The endpoints are the ones ``RemoteInferenceClient`` (skyrl 0.4) calls, with the
bodies vLLM's server (plus SkyRL's custom endpoints in ``vllm_server_actor.py``) accepts and returns:

=====================================  ===========================================================
``POST /inference/v1/generate``        ``{"token_ids", "model", "sampling_params", "cache_salt"?}``
                                       -> ``{"choices": [{"token_ids", "finish_reason", "logprobs":
                                       {"content": [{"logprob"}]} | null, "adapter_version"}]}``;
                                       ``model`` is a LoRA adapter name or the base model name;
                                       ``adapter_version`` (ours) is the adapter version the whole
                                       completion was sampled with (-1 for the base model)
``POST /skyrl/v1/load_lora_adapter``   ``{"lora_name", "lora_path"}``: loads a PEFT folder in place
                                       under its name; a new name is registered at version 0, a known
                                       one bumps its version by one. Only that adapter's own running
                                       requests fence the swap: other tenants keep decoding
``POST /v1/unload_lora_adapter``       ``{"lora_name"}``: frees the adapter's slot (409 while it has
                                       requests in flight)
``POST /tokenize``, ``/detokenize``    vLLM's bodies: ``{"prompt"}`` -> ``{"tokens"}``;
                                       ``{"tokens"}`` -> ``{"prompt"}``
``POST /pause?mode=keep``, ``/resume`` freeze / continue every in-flight request (keep mode only)
``POST /reset_prefix_cache``           success, nothing dropped: the engine's prefix cache is keyed
                                       by (adapter, version) and a load drops that adapter's
                                       entries, so no entry can serve stale weights
``GET /get_world_size``                ``{"world_size": 1}``
``POST /sleep``, ``/wake_up``,         success / ``{"is_sleeping": false}``: the base model stays
``GET /is_sleeping``                   resident for every tenant
``POST /finish_session``               success: sessions hold no engine state
``POST /collective_rpc``               ``skyrl_discard_in_memory_lora`` only (called after an unload;
                                       nothing is staged in memory here)
=====================================  ===========================================================

Every request must carry ``Authorization: Bearer <token>`` with the server's :attr:`EmbeddedServer.token` (drawn
per server; its clients get it in memory with its URL, as a
:class:`~skyrl_clora.backends.skyrl.bearer_client.BearerInferenceClient`'s ``api_key``); any other request, on any path, is
answered 401 before its handler runs.

Errors are JSON ``{"error": {"message": ...}}`` with a 4xx status, which ``raise_for_status`` in SkyRL's
client turns into an exception carrying the message.

Each request's RNG seed is ``sampling_params.seed`` when given, else derived from (server seed, model,
``X-Session-ID`` header, prompt length) as in :class:`~skyrl_clora.sampler.client.EmbeddedInferenceClient`,
so a rollout is reproducible whatever the interleaving of tenants (the engine is batch-invariant).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

from skyrl_clora.control.auth import bearer_auth, new_token
from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.requests import SamplingParams, derive_seed

# Sampling keys SkyRL's vLLM params carry that the engine honours, or that are no-ops at these values.
_NEUTRAL_SAMPLING = {
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "n": (None, 1),
    "stop": (None, [], ()),
    "ignore_eos": (None, False),
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "min_tokens": (None, 0, 1),
}
# Keys that only shape detokenized text or stop strings, which this token-in/token-out endpoint never returns.
_TEXT_ONLY_SAMPLING = ("skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens")
_ENGINE_SAMPLING = ("max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "logprobs")


class RequestError(Exception):
    """A bad request: answered with ``status`` and a JSON error body holding the one-line message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class EmbeddedServer:
    """Serves one :class:`EngineThread` over SkyRL's inference HTTP protocol (see module docstring).

    :meth:`start` binds 127.0.0.1 on a free port and runs the server in a background thread with its own
    event loop; :attr:`url` is then the base URL to give ``RemoteInferenceClient`` as both ``proxy_url``
    and its one ``server_urls`` entry, with :attr:`token` as its ``api_key``. The engine is owned by the caller
    (``stop`` does not shut it down).
    """

    def __init__(self, engine: EngineThread, tokenizer: Any, model_name: str, seed: int = 0) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.seed = seed
        self.token = new_token()
        self.url: str | None = None
        self._in_flight: Counter[str] = Counter()
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._anonymous_requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> str:
        """Starts serving; returns the base URL (``http://127.0.0.1:<port>``)."""
        if self._thread is not None:
            raise RuntimeError("the server is already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._runner = web.AppRunner(self.app(), access_log=None)
                self._loop.run_until_complete(self._runner.setup())
                self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
            except BaseException as error:  # reported to start()'s caller below
                errors.append(error)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="clora-skyrl-server", daemon=True)
        self._thread.start()
        started.wait()
        if errors:
            raise RuntimeError(f"the embedded SkyRL server failed to start: {errors[0]}")
        return self.url

    def stop(self) -> None:
        """Stops serving and joins the server thread (the engine keeps running)."""
        if self._thread is None or self._loop is None or self._runner is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._thread = None

    def app(self) -> web.Application:
        """The aiohttp application with every endpoint of the module docstring."""
        auth = bearer_auth(self.token, lambda message: _error_body(message, 401),
                           "the token of this EmbeddedServer, its clients' api_key")
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[auth, _json_errors])
        app.add_routes([
            web.post("/inference/v1/generate", self._generate),
            web.post("/skyrl/v1/generate", self._packed_generate),
            web.post("/skyrl/v1/load_lora_adapter", self._load_lora_adapter),
            web.post("/v1/unload_lora_adapter", self._unload_lora_adapter),
            web.post("/tokenize", self._tokenize),
            web.post("/detokenize", self._detokenize),
            web.post("/pause", self._pause),
            web.post("/resume", self._resume),
            web.post("/reset_prefix_cache", self._ok),
            web.post("/sleep", self._ok),
            web.post("/wake_up", self._ok),
            web.get("/is_sleeping", self._is_sleeping),
            web.get("/get_world_size", self._world_size),
            web.post("/finish_session", self._ok),
            web.post("/collective_rpc", self._collective_rpc),
        ])
        return app

    # ---- data plane --------------------------------------------------------------------------

    def _adapter(self, model: str | None) -> str | None:
        """The engine adapter for a request's ``model`` (None: the base model)."""
        if model in (None, "", self.model_name):
            return None
        try:
            self.engine.adapter_version(model)
        except KeyError:
            raise RequestError(f"The model `{model}` does not exist.", status=404) from None
        return model

    def _sampling(self, raw: dict[str, Any], model: str | None, session: str, prompt_len: int) -> tuple[SamplingParams, bool]:
        """Engine sampling params from vLLM-style ``raw`` params, plus whether logprobs were asked for."""
        for key, value in raw.items():
            if key in _ENGINE_SAMPLING or key in _TEXT_ONLY_SAMPLING:
                continue
            if key not in _NEUTRAL_SAMPLING:
                raise RequestError(f"sampling param {key!r} is not supported by the embedded engine")
            if value not in _NEUTRAL_SAMPLING[key]:
                raise RequestError(f"sampling param {key}={value!r} is not supported by the embedded engine")
        logprobs = raw.get("logprobs")
        if logprobs not in (None, 0, 1):
            raise RequestError(f"logprobs={logprobs!r} is not supported: the engine returns the sampled token's only")
        max_tokens = raw.get("max_tokens") or self.engine.max_len - prompt_len
        seed = raw.get("seed")
        stop_ids = [self.tokenizer.eos_token_id, *(raw.get("stop_token_ids") or [])]
        params = SamplingParams(
            max_tokens=int(max_tokens),
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            stop_token_ids=tuple(int(t) for t in stop_ids if t is not None),
            seed=int(seed) if seed is not None else derive_seed(self.seed, session, prompt_len),
        )
        return params, logprobs is not None

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        token_ids = body.get("token_ids")
        if not isinstance(token_ids, list) or not token_ids:
            raise RequestError("'token_ids' must be a non-empty list of token ids")
        model = body.get("model")
        adapter = self._adapter(model)
        session = request.headers.get("X-Session-ID")
        if session is None:
            self._anonymous_requests += 1
            session = f"request-{self._anonymous_requests}"
        params, want_logprobs = self._sampling(body.get("sampling_params") or {}, model, session, len(token_ids))
        key = adapter or ""
        self._in_flight[key] += 1
        try:
            completion = await asyncio.wrap_future(self.engine.submit(token_ids, adapter, params))
        except ValueError as error:
            raise RequestError(str(error)) from None
        finally:
            self._in_flight[key] -= 1
        logprobs = {"content": [{"logprob": lp} for lp in completion.logprobs]} if want_logprobs else None
        return web.json_response({
            "choices": [{
                "index": 0,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "logprobs": logprobs,
                "adapter_version": completion.adapter_version,
            }]
        })

    async def _packed_generate(self, request: web.Request) -> web.Response:
        raise RequestError(
            "routed experts and sample-support capture are not available on the embedded engine; "
            "set enable_return_routed_experts=false and enable_return_sample_support_set=false"
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = self.tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_len})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": self.tokenizer.decode(body["tokens"])})

    # ---- control plane -----------------------------------------------------------------------

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if body.get("in_memory"):
            raise RequestError("in-memory LoRA loading needs vLLM's weight transport; use lora.sync_mode=disk")
        if not name or not path:
            raise RequestError("'lora_name' plus 'lora_path' must be provided")
        lock = self._load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            try:
                weights = await asyncio.to_thread(load_peft_adapter, Path(path))
            except (ValueError, OSError) as error:
                raise RequestError(str(error)) from None
            try:
                version = self.engine.adapter_version(name) + 1
            except KeyError:
                version = 0
            try:
                if version == 0:
                    await asyncio.to_thread(self.engine.register_adapter, name, weights, 0)
                else:
                    await asyncio.wrap_future(self.engine.publish(name, weights, version))
            except ValueError as error:
                raise RequestError(str(error)) from None
        return web.json_response({"status": "ok", "lora_name": name, "version": version})

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        name = (await request.json()).get("lora_name")
        if name in (None, "", self.model_name):
            raise RequestError("'lora_name' must name a loaded LoRA adapter")
        self._adapter(name)
        if self._in_flight[name]:
            raise RequestError(f"adapter {name!r} has {self._in_flight[name]} requests in flight; unload it after them",
                               status=409)
        await asyncio.wrap_future(self.engine.unregister_adapter(name))
        self._load_locks.pop(name, None)
        return web.json_response({"status": "ok", "lora_name": name})

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "keep")
        if mode != "keep":
            raise RequestError(f"pause mode={mode} is not supported by the embedded engine; use mode=keep")
        self.engine.pause()
        return web.json_response({"status": "ok"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"status": "ok"})

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    async def _world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        method = (await request.json()).get("method")
        if method != "skyrl_discard_in_memory_lora":
            raise RequestError(f"collective_rpc method {method!r} is not available on the embedded engine")
        return web.json_response({"status": "ok"})


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turns :class:`RequestError` (and malformed JSON) into a JSON error body SkyRL's client can read."""
    try:
        return await handler(request)
    except RequestError as error:
        return _error(str(error), error.status)
    except (ValueError, KeyError, TypeError) as error:  # malformed body: a missing key or bad JSON
        return _error(f"bad request body: {type(error).__name__}: {error}", 400)


def _error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "code": status}}


def _error(message: str, status: int) -> web.Response:
    return web.json_response(_error_body(message, status), status=status)
