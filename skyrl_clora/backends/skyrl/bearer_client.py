"""SkyRL's ``RemoteInferenceClient`` sending ``Authorization: Bearer <api_key>`` with every request.

SkyRL 0.4's client sends no credentials: every request it makes (data plane, control-plane fan-out, LoRA loads)
goes through the one ``aiohttp.ClientSession`` per event loop that ``RemoteGenerateClient._get_session`` opens, so
the header is set there, as a default header of that session. ``api_key`` is a dataclass field: it travels with
the client when SkyRL pickles it to a Ray worker (``init_weight_sync_state``). Upstream form:
``integration/patches/0004-remote-inference-client-api-key.patch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import aiohttp
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
    RemoteGenerateClient,
    RemoteInferenceClient,
)

from skyrl_clora.control.auth import authorization


@dataclass
class BearerGenerateClient(RemoteGenerateClient):
    """``RemoteGenerateClient`` whose sessions send ``api_key`` as a bearer token (none when it is None)."""

    api_key: Optional[str] = field(default=None, repr=False)

    async def _get_session(self) -> aiohttp.ClientSession:
        session = await super()._get_session()
        if self.api_key is not None:
            session.headers.update(authorization(self.api_key))
        return session


@dataclass
class BearerInferenceClient(RemoteInferenceClient):
    """``RemoteInferenceClient`` whose every request carries ``Authorization: Bearer <api_key>`` (none when it is
    None)."""

    api_key: Optional[str] = field(default=None, repr=False)

    def _get_generate_client(self) -> RemoteGenerateClient:
        if self._generate_client is None:
            self._generate_client = BearerGenerateClient(proxy_url=self.proxy_url, api_key=self.api_key)
        return self._generate_client
