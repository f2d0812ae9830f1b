"""SkyRL's ``InferenceEngineInterface`` over the embedded engine (skyrl_clora.sampler.client): SkyRL's
``SkyRLGymGenerator`` drives it for several tenants at once; the tenant rides in ``model=`` (the base model under
its own name or none); each request's sampling settings are the client's defaults under the call's, stopping at the
tokenizer's end token too, and its seed derives from the client seed, session and prompt length; every request's
adapter version is recorded per adapter and session; log-probs are returned only when asked for; the OpenAI-style
calls wrap one request; a PEFT folder loads as a new adapter's version 0 or a known one's next version."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import pytest
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
from skyrl.train.config import SamplingParams as SkyRLSamplingParams
from skyrl.train.generators.base import GeneratorInput, TrajectoryID
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from transformers import AutoTokenizer

import skyrl_clora.sampler.client as client_module
from skyrl_clora.recipes.gsm8k.env import register_gsm8k_env
from skyrl_clora.recipes.gsm8k.problems import make_dataset_rows
from skyrl_clora.sampler.client import EmbeddedInferenceClient
from skyrl_clora.sampler.requests import Completion, SamplingParams, derive_seed

from tests.support.engine_threads import engine_on as _engine


def test_skyrl_gym_generator_drives_the_client_for_several_tenants(micro_model_dir: Path) -> None:
    register_gsm8k_env()
    tokenizer = AutoTokenizer.from_pretrained(micro_model_dir)
    engine, _ = _engine(micro_model_dir, num_rows=8, adapters={"t0": 1, "t1": 2})
    client = EmbeddedInferenceClient(engine, tokenizer, model_name=str(micro_model_dir),
                                     default_sampling={"max_tokens": 10, "logprobs": 1}, seed=0)
    config = GeneratorConfig(max_turns=2, batched=False, max_input_length=80,
                             sampling_params=SkyRLSamplingParams(max_generate_length=10, logprobs=1))
    rows = make_dataset_rows(2, seed=0)

    async def rollout(tenant: str):
        generator = SkyRLGymGenerator(config, SkyRLGymConfig(max_env_workers=0), client, tokenizer, policy_model_name=tenant)
        ids = [TrajectoryID(instance_id=f"{tenant}-{i}", repetition_id=0) for i in range(len(rows))]
        output = await generator.generate(GeneratorInput(
            prompts=[r["prompt"] for r in rows], env_classes=[r["env_class"] for r in rows],
            env_extras=[{k: v for k, v in r.items() if k not in ("prompt", "env_class")} for r in rows],
            sampling_params=None, trajectory_ids=ids, batch_metadata=None), disable_tqdm=True)
        return output, ids

    async def both():
        return await asyncio.gather(rollout("t0"), rollout("t1"))

    try:
        (out0, ids0), (out1, ids1) = asyncio.run(both())
    finally:
        engine.shutdown()
    assert out0["response_ids"] != out1["response_ids"], "tenants' episodes must differ"
    for output in (out0, out1):
        assert len(output["response_ids"]) == 2
        assert all(len(lp) == len(r) for lp, r in zip(output["rollout_logprobs"], output["response_ids"]))
    for tenant, ids in (("t0", ids0), ("t1", ids1)):
        for trajectory in ids:
            versions = client.versions_for(tenant, trajectory.to_string())
            assert versions and set(versions) == {0}


class _RecordingEngine:
    """Stands in for an ``EngineThread``: records each submitted request and completes it at once with tokens 7, 8
    (``finish_reason`` "stop") sampled at its adapter's version (``versions``; -1 for the base model); records
    registrations, publishes and pauses."""

    def __init__(self, versions: dict[str, int]) -> None:
        self.versions = dict(versions)
        self.submitted: list[tuple[list[int], str | None, SamplingParams]] = []
        self.registered: list[tuple[str, Any, int]] = []
        self.published: list[tuple[str, Any, int]] = []
        self.pauses = 0

    def submit(self, prompt_ids: list[int], adapter: str | None, params: SamplingParams) -> concurrent.futures.Future:
        self.submitted.append((list(prompt_ids), adapter, params))
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(Completion([7, 8], [-0.5, -1.25], "stop", self.versions.get(adapter, -1)))
        return future

    def adapter_version(self, name: str) -> int:
        return self.versions[name]

    def register_adapter(self, name: str, weights: Any, version: int = 0) -> None:
        self.registered.append((name, weights, version))
        self.versions[name] = version

    def publish(self, name: str, weights: Any, version: int) -> concurrent.futures.Future:
        self.published.append((name, weights, version))
        self.versions[name] = version
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(None)
        return future

    def pause(self) -> None:
        self.pauses += 1

    def resume(self) -> None:
        self.pauses -= 1


def _client(model_dir: Path, default_sampling: dict[str, Any], versions: dict[str, int] | None = None,
            seed: int = 5) -> tuple[EmbeddedInferenceClient, _RecordingEngine]:
    engine = _RecordingEngine(versions or {"t0": 3})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return EmbeddedInferenceClient(engine, tokenizer, model_name="base", default_sampling=default_sampling,
                                   seed=seed), engine


def test_the_call_settings_override_the_defaults_and_the_end_token_always_stops(micro_model_dir: Path) -> None:
    client, engine = _client(micro_model_dir, {"max_tokens": 10, "temperature": 0.7, "top_p": 0.9,
                                               "stop_token_ids": [11]})
    eos = client.tokenizer.eos_token_id
    asyncio.run(client.generate({"prompt_token_ids": [[1, 2, 3]], "sampling_params": {"max_tokens": 4, "top_p": 0.5,
                                                                                     "stop_token_ids": [12, 13]}}))
    asyncio.run(client.generate({"prompt_token_ids": [[1, 2, 3]]}))
    (_, _, called), (_, _, default) = engine.submitted
    assert (called.max_tokens, called.temperature, called.top_p, called.stop_token_ids) == (4, 0.7, 0.5, (eos, 12, 13))
    assert (default.max_tokens, default.temperature, default.top_p, default.stop_token_ids) == (10, 0.7, 0.9, (eos, 11))
    skyrl_style, skyrl_engine = _client(micro_model_dir, {"max_generate_length": 6})
    asyncio.run(skyrl_style.generate({"prompt_token_ids": [[1]]}))
    assert skyrl_engine.submitted[-1][2].max_tokens == 6 and skyrl_engine.submitted[-1][2].temperature == 1.0
    bare, _ = _client(micro_model_dir, {})
    with pytest.raises(ValueError, match="sampling params need max_tokens"):
        asyncio.run(bare.generate({"prompt_token_ids": [[1]]}))


def test_the_tenant_rides_in_model_and_each_seed_comes_from_client_seed_session_and_prompt_length(
        micro_model_dir: Path) -> None:
    client, engine = _client(micro_model_dir, {"max_tokens": 4}, seed=5)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
    output = asyncio.run(client.generate({"prompt_token_ids": prompts, "session_ids": ["s", "s", 9]}, model="t0"))
    assert [adapter for _, adapter, _ in engine.submitted] == ["t0"] * 3
    assert [params.seed for _, _, params in engine.submitted] == [
        derive_seed(5, "s", 3), derive_seed(5, "s", 2), derive_seed(5, "9", 3)]
    assert [ids for ids, _, _ in engine.submitted] == prompts
    assert output["response_ids"] == [[7, 8]] * 3 and output["stop_reasons"] == ["stop"] * 3
    assert output["responses"] == [client.tokenizer.decode([7, 8], skip_special_tokens=True)] * 3
    assert client.versions_for("t0", "s") == [3, 3] and client.versions_for("t0", "9") == [3]
    assert client.versions_for(None, "s") == [] and client.versions_for("t0", "other") == []
    for model in (None, "base"):
        asyncio.run(client.generate({"prompt_token_ids": [[1]], "session_ids": ["b"]}, model=model))
        assert engine.submitted[-1][1] is None, "the base model under its own name, or no name"
    assert client.versions_for(None, "b") == [-1, -1]


def test_requests_without_a_session_get_a_session_each(micro_model_dir: Path) -> None:
    client, engine = _client(micro_model_dir, {"max_tokens": 4})
    asyncio.run(client.generate({"prompt_token_ids": [[1, 2], [1, 2]]}, model="t0"))
    asyncio.run(client.generate({"prompt_token_ids": [[1, 2]], "session_ids": [None]}, model="t0"))
    seeds = [params.seed for _, _, params in engine.submitted]
    assert seeds == [derive_seed(5, f"request-{i}", 2) for i in (1, 2, 3)] and len(set(seeds)) == 3
    assert [client.versions_for("t0", f"request-{i}") for i in (1, 2, 3)] == [[3], [3], [3]]


def test_log_probs_are_returned_only_when_asked_for(micro_model_dir: Path) -> None:
    client, _ = _client(micro_model_dir, {"max_tokens": 4})
    assert asyncio.run(client.generate({"prompt_token_ids": [[1]]}))["response_logprobs"] is None
    asked = asyncio.run(client.generate({"prompt_token_ids": [[1]], "sampling_params": {"logprobs": 0}}))
    assert asked["response_logprobs"] == [[-0.5, -1.25]]
    by_default, _ = _client(micro_model_dir, {"max_tokens": 4, "logprobs": 1})
    assert asyncio.run(by_default.generate({"prompt_token_ids": [[1]]}))["response_logprobs"] == [[-0.5, -1.25]]


def test_the_openai_style_calls_wrap_one_request(micro_model_dir: Path) -> None:
    """A chat completion renders the messages with the chat template, its ``user`` naming the session; a text
    completion encodes the prompt without special tokens; both take only max_tokens, temperature and top_p from the
    body and answer in OpenAI's form, naming the model asked for (the client's own when none)."""
    client, engine = _client(micro_model_dir, {"max_tokens": 10})
    messages = [{"role": "user", "content": "What is 4*17+23?"}]
    chat = asyncio.run(client.chat_completion({"json": {"messages": messages, "model": "t0", "max_tokens": 3,
                                                        "user": "u1", "logprobs": 1, "top_k": 2}}))
    rendered = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    ids, adapter, params = engine.submitted[-1]
    assert ids == rendered and adapter == "t0" and params.max_tokens == 3
    assert params.seed == derive_seed(5, "u1", len(rendered))
    text = client.tokenizer.decode([7, 8], skip_special_tokens=True)
    assert chat == {"object": "chat.completion", "model": "t0", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    completion = asyncio.run(client.completion({"json": {"prompt": "4*17", "temperature": 0.5}}))
    ids, adapter, params = engine.submitted[-1]
    assert ids == client.tokenizer.encode("4*17", add_special_tokens=False) and adapter is None
    assert (params.max_tokens, params.temperature) == (10, 0.5)
    assert completion == {"object": "text_completion", "model": "base",
                          "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]}
    render = asyncio.run(client.render_chat_completion({"json": {"messages": messages}}))
    assert render == {"prompt_token_ids": rendered, "prompt": client.tokenizer.decode(rendered)}


def test_a_lora_load_registers_a_new_adapter_and_publishes_a_known_ones_next_version(
        micro_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[Path] = []
    monkeypatch.setattr(client_module, "load_peft_adapter",
                        lambda path: loaded.append(path) or f"weights of {path.name}")
    client, engine = _client(micro_model_dir, {"max_tokens": 4}, versions={"t0": 3})
    assert asyncio.run(client.load_lora_adapter("t1", "/adapters/one")) == {"lora_name": "t1", "version": 0}
    assert asyncio.run(client.load_lora_adapter("t0", "/adapters/two")) == {"lora_name": "t0", "version": 4}
    assert loaded == [Path("/adapters/one"), Path("/adapters/two")]
    assert engine.registered == [("t1", "weights of one", 0)] and engine.published == [("t0", "weights of two", 4)]


def test_pauses_reach_the_engine_and_what_the_embedded_engine_has_not_is_refused(micro_model_dir: Path) -> None:
    client, engine = _client(micro_model_dir, {"max_tokens": 4})
    asyncio.run(client.pause_generation())
    assert engine.pauses == 1
    asyncio.run(client.resume_generation())
    assert engine.pauses == 0
    assert asyncio.run(client.get_world_size()) == (1, 1) and client.model_name == "base"
    with pytest.raises(NotImplementedError, match="in-process"):
        client.get_endpoint_url()
    with pytest.raises(NotImplementedError, match="publish adapters instead"):
        asyncio.run(client.update_named_weights(None))
