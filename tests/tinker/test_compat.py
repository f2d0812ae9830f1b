"""skyrl_clora.tinker.compat: what the tinker SDK 0.38 needs beyond SkyRL 0.4's server, driven with the real SDK
against real servers (the plumbing test double as their backend): this project's (``tinker_server``) and SkyRL's own
with integration/patches/0007 applied (``patched_skyrl_server``), which must behave alike."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from skyrl_clora.tinker.compat import TopkProto
from tests.tinker.conftest import TinkerServer

UNLOAD_TIMEOUT_S = 120.0  # a generous bound on the engine's unload; not a timing


@pytest.fixture(params=["tinker_server", "patched_skyrl_server"])
def server(request: pytest.FixtureRequest) -> TinkerServer:
    return request.getfixturevalue(request.param)


def _client(server: TinkerServer) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.url, api_key=server.key)


def _post(server: TinkerServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"X-API-Key": server.key})


def test_the_with_block_exit_finishes_the_session_and_unloads_its_models(server: TinkerServer) -> None:
    with _client(server) as service:
        training = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
        session_id = service.holder.get_session_id()
        assert _post(server, "/api/v1/get_info", {"model_id": training.model_id}).json()["status"] != "unloaded"
    deadline = time.monotonic() + UNLOAD_TIMEOUT_S
    while (status := _post(server, "/api/v1/get_info", {"model_id": training.model_id}).json()["status"]) != (
            "unloaded"):
        assert status == "unloading" and time.monotonic() < deadline, status
        time.sleep(0.2)
    assert _post(server, f"/api/v1/sessions/{session_id}/finish", {}).status_code == 200  # first finish wins
    assert _post(server, "/api/v1/sessions/session_unknown/finish", {}).status_code == 404


def test_a_sample_carries_one_sequence_id_per_sequence(server: TinkerServer) -> None:
    with _client(server) as service:
        training = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([1, 2, 3])
        result = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=4, seed=10)).result()
        again = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=10)).result()
    assert [sequence.tokens for sequence in result.sequences] == [[10, 11, 12, 13], [11, 12, 13, 14], [12, 13, 14, 15]]
    ids = [sequence.sequence_id for sequence in [*result.sequences, *again.sequences]]
    assert all(re.fullmatch(r"\d+:\d", sequence_id) for sequence_id in ids) and len(set(ids)) == 4


def test_topk_prompt_logprobs_reach_the_sdk(server: TinkerServer) -> None:
    with _client(server) as service:
        sampler = service.create_sampling_client(base_model=server.base_model).result()
        result = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2),
                                include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
    assert result.prompt_logprobs == [None, -1.0, -1.0]
    assert result.topk_prompt_logprobs == [None, [(0, -1.0), (1, -2.0)], [(0, -1.0), (1, -2.0)]]


def test_the_topk_proto_builds_the_renamed_message() -> None:
    message = TopkProto(pb).TopkPromptLogprobs(prompt_length=3, k=2, token_ids=b"", logprobs=b"")
    assert isinstance(message, pb.TopkLogprobs) and (message.length, message.k) == (3, 2)
    assert TopkProto(pb).SampleResponse is pb.SampleResponse


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_training_client_is_created_from_a_saved_state(server: TinkerServer, with_optimizer: bool) -> None:
    adam = types.AdamParams(learning_rate=1e-4)
    with _client(server) as service:
        source = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
        assert [source.optim_step(adam).result().metrics["steps"] for _ in range(2)] == [1.0, 2.0]
        saved = source.save_state(name="two-steps").result().path
        create = (service.create_training_client_from_state_with_optimizer if with_optimizer
                  else service.create_training_client_from_state)
        loaded = create(saved).result()
        assert re.fullmatch(rf"{service.holder.get_session_id()}:train:\d+", loaded.model_id)
        assert loaded.optim_step(adam).result().metrics["steps"] == 3.0  # the backend loaded the source's checkpoint
        assert loaded.get_info().model_data.model_name == server.base_model


def test_a_load_without_model_or_session_is_refused(tinker_server: TinkerServer) -> None:
    answer = _post(tinker_server, "/api/v1/load_weights", {"path": "tinker://m/weights/c", "optimizer": False})
    assert answer.status_code == 400 and "model_id, or session_id and model_seq_id" in answer.json()["detail"]
    answer = _post(tinker_server, "/api/v1/load_weights", {"session_id": "session_unknown", "model_seq_id": 0,
                                                           "path": "tinker://m/weights/c", "optimizer": False})
    assert answer.status_code == 404


def _checkpoints_of_a_model_created_by_load(server: TinkerServer) -> httpx.Response:
    with _client(server) as service:
        source = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
        loaded = service.create_training_client_from_state(source.save_state(name="s").result().path).result()
        loaded.save_weights_for_sampler(name="w").result()
        return httpx.get(f"{server.url}/api/v1/training_runs/{loaded.model_id}/checkpoints",
                         headers={"X-API-Key": server.key})


def test_checkpoints_of_a_model_created_by_load_are_listed_with_the_patch_only(
        tinker_server: TinkerServer, patched_skyrl_server: TinkerServer) -> None:
    """The SDK's id of a model created by load has ':', which SkyRL 0.4's checkpoint routes refuse (422, naming the
    id's pattern); patch 0007 lets model ids take ':' there."""
    refused = _checkpoints_of_a_model_created_by_load(tinker_server)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["path", "unique_id"]
    listed = _checkpoints_of_a_model_created_by_load(patched_skyrl_server)
    assert [checkpoint["checkpoint_id"] for checkpoint in listed.json()["checkpoints"]] == ["w"]
