"""The adapter version each request of a tenant was sampled with, as its view records it: the server's report when
there is one (the embedded server), else (vLLM) the view's own version around the request; the tenant loop's
check then holds on vLLM too."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from unittest.mock import patch

import pytest
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.train.generators.base import TrajectoryID

from skyrl_clora.backends.skyrl.bearer_client import BearerInferenceClient
from skyrl_clora.backends.skyrl.tenant_client import UNKNOWN_VERSION, tenant_views
from skyrl_clora.tenant_loop import Rollout, check_sampled_versions


class _Server:
    """The stock generate client's answer; ``during`` runs while the request is out (e.g. a sync landing)."""

    def __init__(self, reported: int | None = None, during=None) -> None:
        self.reported, self.during = reported, during

    async def generate(self, **kwargs):
        if self.during is not None:
            self.during()
        choice = {} if self.reported is None else {"adapter_version": self.reported}
        return SimpleNamespace(raw_response={"choices": [choice]})


def _view_at(version: int):
    client = RemoteInferenceClient(proxy_url="http://127.0.0.1:1", server_urls=["http://127.0.0.1:1"],
                                   data_parallel_size=1, model_name="base")
    view = tenant_views(client, ["t"])["t"]
    view.resume_weight_version(version)
    return view


def _request(view, server: _Server, session: str) -> list[int]:
    with patch.object(BearerInferenceClient, "_get_generate_client", return_value=server):
        asyncio.run(view._get_generate_client().generate(session_id=session))
    return view.versions_for(session)


def _check(versions: list[int], began_at: int, now: int) -> None:
    trajectory = TrajectoryID(instance_id="p0", repetition_id=0)
    check_sampled_versions("t", Rollout({}, ["g"], [trajectory], [versions]), began_at, now)


def test_without_a_server_report_the_views_version_is_recorded_and_checked() -> None:
    view = _view_at(3)
    assert _request(view, _Server(), "s") == [3]
    _check(view.versions_for("s"), began_at=3, now=3)
    with pytest.raises(RuntimeError, match=r"sampled with adapter versions \[3\]; its step began at version 2"):
        _check(view.versions_for("s"), began_at=2, now=2)


def test_a_sync_landing_during_a_request_fails_the_check() -> None:
    view = _view_at(3)
    recorded = _request(view, _Server(during=view.increment_weight_version), "s")
    assert recorded == [UNKNOWN_VERSION]
    with pytest.raises(RuntimeError, match="sampled with adapter versions"):
        _check(recorded, began_at=3, now=3)


def test_the_servers_report_wins() -> None:
    view = _view_at(3)
    assert _request(view, _Server(reported=5), "s") == [5]
