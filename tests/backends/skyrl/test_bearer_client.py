"""SkyRL's ``RemoteInferenceClient`` with a bearer token (skyrl_clora.backends.skyrl.bearer_client): every session its
generate client opens, on any event loop, sends ``Authorization: Bearer <api_key>`` (none without a key); the key
travels with the client when it is pickled (as SkyRL ships it to a Ray worker) and never shows in its repr."""

from __future__ import annotations

import asyncio
import pickle

from skyrl_clora.backends.skyrl.bearer_client import BearerGenerateClient, BearerInferenceClient

URL = "http://127.0.0.1:1"


def _client(api_key: str | None) -> BearerInferenceClient:
    return BearerInferenceClient(proxy_url=URL, server_urls=[URL], data_parallel_size=1, model_name="base",
                                 api_key=api_key)


def _session_authorization(client: BearerInferenceClient) -> str | None:
    """The Authorization header of the session the client's generate client opens on a new event loop."""

    async def opened() -> str | None:
        session = await client._get_generate_client()._get_session()
        try:
            return session.headers.get("Authorization")
        finally:
            await session.close()

    return asyncio.run(opened())


def test_every_session_on_every_loop_sends_the_token() -> None:
    client = _client("s3cret")
    generate = client._get_generate_client()
    assert isinstance(generate, BearerGenerateClient) and generate.api_key == "s3cret"
    assert client._get_generate_client() is generate and generate.proxy_url == URL
    assert [_session_authorization(client) for _ in range(2)] == ["Bearer s3cret"] * 2


def test_without_a_key_no_authorization_is_sent() -> None:
    client = _client(None)
    assert client._get_generate_client().api_key is None
    assert _session_authorization(client) is None


def test_the_key_travels_with_a_pickled_client_and_stays_out_of_its_repr() -> None:
    client = _client("s3cret")
    client._get_generate_client()
    shipped = pickle.loads(pickle.dumps(client))
    assert shipped.api_key == "s3cret" and shipped._generate_client is None
    assert _session_authorization(shipped) == "Bearer s3cret"
    assert "s3cret" not in repr(client) and "s3cret" not in repr(client._get_generate_client())
