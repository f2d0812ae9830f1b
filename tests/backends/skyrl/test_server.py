"""The embedded engine served over HTTP by skyrl_clora.backends.skyrl.server, driven by SkyRL's own
RemoteInferenceClient and SkyRLGymGenerator.

Four tenants share one engine behind :class:`EmbeddedServer`; each is a LoRA adapter loaded over HTTP from a
PEFT folder and driven through its :class:`TenantInferenceClient` view. Every route refuses a request without the
server's token (status 401, nothing changed) and works with it; SkyRL's client sends it as a
:class:`BearerInferenceClient`.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
from skyrl.train.config import SamplingParams as SkyRLSamplingParams
from skyrl.train.generators.base import GeneratorInput, TrajectoryID
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from skyrl.train.generators.utils import build_vllm_cache_salt
from transformers import AutoModelForCausalLM, AutoTokenizer

from skyrl_clora.lora.peft_export import save_peft_adapter
from skyrl_clora.recipes.gsm8k.env import register_gsm8k_env
from skyrl_clora.recipes.gsm8k.problems import make_dataset_rows
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.backends.skyrl.bearer_client import BearerInferenceClient
from skyrl_clora.backends.skyrl.server import EmbeddedServer
from skyrl_clora.backends.skyrl.tenant_client import TenantInferenceClient, tenant_views

from tests.support.helpers import http_call, random_adapter

TENANTS = ["t0", "t1", "t2", "t3"]
PROMPT = list(range(5, 25))


class Stack:
    """Engine + HTTP server + SkyRL client + one view per tenant, with each tenant's PEFT folder on disk."""

    def __init__(self, model_dir: Path, tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        routing, self.layers = attach_engine_lora(model, num_slots=len(TENANTS), max_rank=8)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.engine = EngineThread(Engine(model, self.layers, EngineConfig(num_rows=12, max_len=112)))
        self.model_dir = str(model_dir)
        self.server = EmbeddedServer(self.engine, self.tokenizer, model_name=self.model_dir, seed=0)
        url = self.server.start()
        self.client = BearerInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1,
                                            model_name=self.model_dir, uses_lora_weight_sync=True,
                                            api_key=self.server.token)
        self.views = tenant_views(self.client, TENANTS)
        self.sync_dir = tmp / "sync"
        self.peft = {}
        for i, tenant in enumerate(TENANTS):
            self.peft[tenant] = tmp / "initial" / tenant
            save_peft_adapter(random_adapter(self.layers, 100 + i), self.peft[tenant], self.model_dir)

    async def load_all(self) -> None:
        for tenant in TENANTS:
            await self.views[tenant].load_lora_adapter(tenant, str(self.peft[tenant]))

    async def close_sessions(self) -> None:
        """Closes the HTTP sessions the clients opened on the running event loop."""
        for client in [self.client, *self.views.values()]:
            await client.teardown()

    def close(self) -> None:
        self.server.stop()
        self.engine.shutdown()


@pytest.fixture
def stack(micro_model_dir: Path, tmp_path: Path):
    built = Stack(micro_model_dir, tmp_path)
    yield built
    built.close()


def _sampling(max_tokens: int) -> dict:
    return get_sampling_params_for_backend("vllm", SkyRLSamplingParams(max_generate_length=max_tokens, logprobs=1))


async def _generate(view: TenantInferenceClient, session: str, max_tokens: int) -> dict:
    return await view.generate(
        {"prompt_token_ids": [PROMPT], "session_ids": [session], "sampling_params": _sampling(max_tokens)},
        model=view.tenant,
    )


def test_control_plane_and_tokenizer_endpoints(stack: Stack) -> None:
    async def run():
        client = BearerInferenceClient(proxy_url=stack.server.url, server_urls=[stack.server.url],
                                       data_parallel_size=1, model_name=stack.model_dir, api_key=stack.server.token)
        try:
            assert await client.get_world_size() == (1, 1)
            text = "calculator 12 + 7"
            ids = (await client.tokenize([text], add_special_tokens=False))[0]
            assert ids == stack.tokenizer.encode(text, add_special_tokens=False)
            assert (await client.detokenize([ids]))[0] == stack.tokenizer.decode(ids)
            await client.reset_prefix_cache(reset_running_requests=True)
            await client.pause_generation()
            await client.resume_generation()
            with pytest.raises(aiohttp.ClientResponseError, match="mode=keep"):
                await client.pause(mode="abort")
            await stack.load_all()
            assert {t: v.weight_version for t, v in stack.views.items()} == dict.fromkeys(TENANTS, 0)
            base = await client.generate({"prompt_token_ids": [PROMPT], "sampling_params": _sampling(6)})
            assert len(base["response_ids"][0]) >= 1 and len(base["response_logprobs"][0]) == len(base["response_ids"][0])
            await client.unload_lora_adapter("t3")
            with pytest.raises(aiohttp.ClientResponseError, match="does not exist"):
                await stack.views["t3"].generate({"prompt_token_ids": [PROMPT], "sampling_params": _sampling(4)})
            with pytest.raises(aiohttp.ClientResponseError, match="not supported"):
                await stack.views["t0"].generate({"prompt_token_ids": [PROMPT], "sampling_params": {"top_k": 5}})
            with pytest.raises(ValueError, match="cannot generate for model"):
                await stack.views["t0"].generate({"prompt_token_ids": [PROMPT], "sampling_params": _sampling(4)}, model="t1")
        finally:
            await client.teardown()
            await stack.close_sessions()

    asyncio.run(run())


def test_rollout_log_probs_are_of_the_sampling_temperatures_distribution(stack: Stack, micro_model_dir: Path) -> None:
    """SkyRL's sampling params reach the engine with their temperature: the log-probs returned are
    ``log_softmax(logits / T)`` of the sampled tokens (vLLM's ``processed_logprobs``, what the trainer computes)."""
    params = get_sampling_params_for_backend(
        "vllm", SkyRLSamplingParams(max_generate_length=6, logprobs=1, temperature=0.5))

    async def run() -> dict:
        client = BearerInferenceClient(proxy_url=stack.server.url, server_urls=[stack.server.url], data_parallel_size=1,
                                       model_name=stack.model_dir, api_key=stack.server.token)  # the base model
        try:
            return await client.generate({"prompt_token_ids": [PROMPT], "sampling_params": params})
        finally:
            await client.teardown()

    output = asyncio.run(run())
    response, reported = output["response_ids"][0], torch.tensor(output["response_logprobs"][0])
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + response])).logits[0, len(PROMPT) - 1 : -1].float()
    targets = torch.tensor(response)[:, None]
    tempered = (logits / 0.5).log_softmax(-1).gather(1, targets)[:, 0]
    untempered = logits.log_softmax(-1).gather(1, targets)[:, 0]
    assert (tempered - untempered).abs().max() > 1e-2
    assert torch.allclose(reported, tempered, atol=1e-3)


def test_generator_drives_four_tenants_concurrently(stack: Stack) -> None:
    register_gsm8k_env()
    config = GeneratorConfig(max_turns=2, batched=False, max_input_length=80,
                             sampling_params=SkyRLSamplingParams(max_generate_length=10, logprobs=1))
    rows = make_dataset_rows(2, seed=0)

    async def rollout(tenant: str):
        generator = SkyRLGymGenerator(config, SkyRLGymConfig(max_env_workers=0), stack.views[tenant],
                                      stack.tokenizer, policy_model_name=tenant)
        ids = [TrajectoryID(instance_id=f"{tenant}-{i}", repetition_id=0) for i in range(len(rows))]
        output = await generator.generate(GeneratorInput(
            prompts=[r["prompt"] for r in rows], env_classes=[r["env_class"] for r in rows],
            env_extras=[{k: v for k, v in r.items() if k not in ("prompt", "env_class")} for r in rows],
            sampling_params=_sampling(10), trajectory_ids=ids, batch_metadata=None), disable_tqdm=True)
        return output, ids, generator._compute_cache_salt()

    async def run():
        await stack.load_all()
        try:
            return await asyncio.gather(*(rollout(t) for t in TENANTS))
        finally:
            await stack.close_sessions()

    results = asyncio.run(run())
    outputs = [out["response_ids"] for out, _, _ in results]
    assert len({repr(o) for o in outputs}) == len(TENANTS), "tenants' episodes must differ"
    for tenant, (output, ids, salt) in zip(TENANTS, results):
        assert salt == build_vllm_cache_salt(0, tenant)
        assert len(output["response_ids"]) == len(rows)
        assert all(len(lp) == len(r) for lp, r in zip(output["rollout_logprobs"], output["response_ids"]))
        for trajectory in ids:
            versions = stack.views[tenant].versions_for(f"{trajectory.instance_id}_{trajectory.repetition_id}")
            assert versions and set(versions) == {0}


def test_one_tenants_sync_leaves_other_tenants_in_flight_requests_intact(stack: Stack) -> None:
    others = TENANTS[1:]

    async def run():
        await stack.load_all()
        # Undisturbed run: every tenant's long request, no sync in between.
        reference = await asyncio.gather(*(_generate(stack.views[t], f"{t}-long", 80) for t in others))
        t0_before = await _generate(stack.views["t0"], "t0-short", 8)
        salts_before = {t: build_vllm_cache_salt(v.weight_version, t) for t, v in stack.views.items()}
        # Same requests again; t0's in-place sync lands while they decode.
        def prompt_tokens_seen() -> int:
            return stack.engine.stats.prefill_tokens + stack.engine.stats.cached_prompt_tokens

        prefilled = prompt_tokens_seen()
        in_flight = [asyncio.create_task(_generate(stack.views[t], f"{t}-long", 80)) for t in others]
        while prompt_tokens_seen() < prefilled + len(others) * len(PROMPT):
            await asyncio.sleep(0.002)
        version = await stack.views["t0"].publish(random_adapter(stack.layers, 999), stack.sync_dir, stack.model_dir)
        pending_at_sync = sum(not task.done() for task in in_flight)
        disturbed = await asyncio.gather(*in_flight)
        # Prompt tokens served from the engine's prefix cache by each request after the sync.
        cached, after = {}, {}
        for tenant in ["t0", *others]:
            start = stack.engine.stats.cached_prompt_tokens
            after[tenant] = await _generate(stack.views[tenant], f"{tenant}-short", 8)
            cached[tenant] = stack.engine.stats.cached_prompt_tokens - start
        t0_after = after["t0"]
        await stack.close_sessions()
        return reference, disturbed, t0_before, t0_after, version, pending_at_sync, salts_before, cached

    reference, disturbed, t0_before, t0_after, version, pending, salts_before, cached = asyncio.run(run())
    assert len({tuple(r["response_ids"][0]) for r in reference}) == len(others), "tenants' samples must differ"
    assert all(len(r["response_ids"][0]) > 20 for r in reference), "reference requests must be long enough to overlap"
    assert pending == len(others), "the sync must not wait for (or pause) other tenants' requests"
    for tenant, ref, out in zip(others, reference, disturbed):
        assert out["response_ids"] == ref["response_ids"] and out["response_logprobs"] == ref["response_logprobs"]
        assert stack.views[tenant].versions_for(f"{tenant}-long") == [0, 0]
        assert stack.views[tenant].weight_version == 0
        assert build_vllm_cache_salt(stack.views[tenant].weight_version, tenant) == salts_before[tenant]
    assert version == 1 and stack.views["t0"].weight_version == 1 and stack.engine.adapter_version("t0") == 1
    assert stack.views["t0"].versions_for("t0-short") == [0, 1]
    assert t0_after["response_ids"] != t0_before["response_ids"]
    assert build_vllm_cache_salt(stack.views["t0"].weight_version, "t0") != salts_before["t0"]
    # The sync dropped only t0's cached prefixes: the others' prompt blocks are still served from the cache.
    assert cached["t0"] == 0 and all(cached[t] > 0 for t in others), cached


def test_server_binds_a_fresh_loopback_port_each_time(stack: Stack) -> None:
    second = EmbeddedServer(stack.engine, stack.tokenizer, model_name=stack.model_dir)
    try:
        url = second.start()
        assert url.startswith("http://127.0.0.1:") and url != stack.server.url
    finally:
        second.stop()
    with pytest.raises(RuntimeError, match="already started"):
        stack.server.start()


def _routes(stack: Stack) -> list[tuple[str, str, str, Any, int]]:
    """Every route of the server (method, pattern) with a request it answers with the token (path, body, status),
    in an order in which each is answered so on a server without adapters."""
    return [
        ("POST", "/inference/v1/generate", "/inference/v1/generate",
         {"token_ids": PROMPT, "model": stack.model_dir, "sampling_params": {"max_tokens": 3}}, 200),
        ("POST", "/skyrl/v1/generate", "/skyrl/v1/generate", {"token_ids": PROMPT}, 400),  # not on this engine
        ("POST", "/skyrl/v1/load_lora_adapter", "/skyrl/v1/load_lora_adapter",
         {"lora_name": "t0", "lora_path": str(stack.peft["t1"])}, 200),
        ("POST", "/v1/unload_lora_adapter", "/v1/unload_lora_adapter", {"lora_name": "t0"}, 200),
        ("POST", "/tokenize", "/tokenize", {"prompt": "calculator 12"}, 200),
        ("POST", "/detokenize", "/detokenize", {"tokens": [5, 6]}, 200),
        ("POST", "/pause", "/pause?mode=keep", None, 200),
        ("POST", "/resume", "/resume", None, 200),
        ("POST", "/reset_prefix_cache", "/reset_prefix_cache", None, 200),
        ("POST", "/sleep", "/sleep", None, 200),
        ("POST", "/wake_up", "/wake_up", None, 200),
        ("GET", "/is_sleeping", "/is_sleeping", None, 200),
        ("GET", "/get_world_size", "/get_world_size", None, 200),
        ("POST", "/finish_session", "/finish_session", None, 200),
        ("POST", "/collective_rpc", "/collective_rpc", {"method": "skyrl_discard_in_memory_lora"}, 200),
    ]


def _engine_state(stack: Stack) -> tuple:
    """What a request could change: each adapter's version (None: not loaded), the pauses, the engine's counters of
    work (its clocks, which tick while it waits for work, left out)."""
    versions = {}
    for name in TENANTS:
        try:
            versions[name] = stack.engine.adapter_version(name)
        except KeyError:
            versions[name] = None
    work = {name: value for name, value in asdict(stack.engine.stats).items()
            if not name.endswith("_seconds") and name != "idle_waits"}
    return versions, stack.engine._pauses, work


def test_every_server_route_is_tested(stack: Stack) -> None:
    served = {(route.method, route.resource.canonical) for route in stack.server.app().router.routes()}
    gets = {("HEAD", pattern) for method, pattern, _, _, _ in _routes(stack) if method == "GET"}
    assert served == {(method, pattern) for method, pattern, _, _, _ in _routes(stack)} | gets


WRONG = {"no header": None, "a wrong token": "Bearer wrong", "another scheme": "Basic {token}",
         "the token and more": "Bearer {token}x", "a non-ASCII token": "Bearer \u00e9", "no token": "Bearer "}


@pytest.mark.parametrize("wrong", WRONG.values(), ids=WRONG.keys())
def test_every_server_route_refuses_a_request_without_the_token_and_changes_nothing(stack: Stack,
                                                                                    wrong: str | None) -> None:
    async def load_all() -> None:
        await stack.load_all()
        await stack.close_sessions()

    asyncio.run(load_all())  # a refused load of t0 would bump its version, a refused unload remove it
    before = _engine_state(stack)
    assert before[0] == dict.fromkeys(TENANTS, 0)
    header = None if wrong is None else wrong.format(token=stack.server.token)
    requests = [(method, path, body) for method, _, path, body, _ in _routes(stack)]
    for method, path, body in [*requests, ("HEAD", "/is_sleeping", None), ("GET", "/no/such/route", None)]:
        status, answer = http_call(stack.server.url + path, method, body, header)
        assert status == 401, (method, path, status, answer)
        if method != "HEAD":
            message = answer["error"]["message"]
            assert message.startswith("missing or wrong token: send the header 'Authorization: Bearer <token>'")
            assert "\n" not in message and answer["error"]["code"] == 401
    assert _engine_state(stack) == before


def test_every_server_route_works_with_the_token(stack: Stack) -> None:
    for method, _, path, body, expected in _routes(stack):
        status, answer = http_call(stack.server.url + path, method, body, f"Bearer {stack.server.token}")
        assert status == expected, (method, path, status, answer)
    assert http_call(stack.server.url + "/no/such/route", "GET", None, f"Bearer {stack.server.token}")[0] == 404
    versions, pauses, stats = _engine_state(stack)
    assert versions == dict.fromkeys(TENANTS) and pauses == 0 and stats["generated_tokens"] > 0  # loaded, unloaded


def test_skyrl_clients_send_the_token_and_a_client_without_it_is_refused(stack: Stack) -> None:
    """The stock client is refused with the one-line reason; the bearer client, its tenant views and its pickled
    copy (what SkyRL hands a Ray worker for the weight syncs) send the token."""
    stock = RemoteInferenceClient(proxy_url=stack.server.url, server_urls=[stack.server.url], data_parallel_size=1,
                                  model_name=stack.model_dir)
    shipped = pickle.loads(pickle.dumps(stack.client))

    async def run() -> None:
        try:
            with pytest.raises(aiohttp.ClientResponseError, match="missing or wrong token") as refused:
                await stock.load_lora_adapter("t0", str(stack.peft["t0"]))
            assert refused.value.status == 401
            with pytest.raises(aiohttp.ClientResponseError, match="missing or wrong token"):
                await stock.generate({"prompt_token_ids": [PROMPT], "sampling_params": _sampling(2)})
            assert await shipped.get_world_size() == (1, 1)
            await shipped.load_lora_adapter("t0", str(stack.peft["t0"]))
            assert stack.views["t1"].api_key == stack.server.token
            await stack.views["t1"].load_lora_adapter("t1", str(stack.peft["t1"]))
            assert len((await _generate(stack.views["t1"], "t1-s", 3))["response_ids"][0]) >= 1
        finally:
            for client in (stock, shipped):
                await client.teardown()
            await stack.close_sessions()

    asyncio.run(run())
    assert stack.engine.adapter_version("t0") == 0 and stack.engine.adapter_version("t1") == 0
