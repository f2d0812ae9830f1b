"""The embedded engine: mixed-tenant continuous batching, version-fenced in-place publish, SkyRL client."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig
from skyrl.train.config import SamplingParams as SkyRLSamplingParams
from skyrl.train.generators.base import GeneratorInput, TrajectoryID
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from skyrl_clora.recipes.gsm8k.env import register_gsm8k_env
from skyrl_clora.recipes.gsm8k.problems import make_dataset_rows
from skyrl_clora.sampler.client import EmbeddedInferenceClient
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.helpers import random_adapter, start_engine

PROMPT = list(range(5, 25))


def _engine(model_dir: Path, num_rows: int, adapters: dict[str, int], max_len: int = 96,
            reuse_decode_kv: bool = False, share_prefix_reads: bool = False, **options) -> tuple[EngineThread, dict]:
    config = EngineConfig(num_rows=num_rows, max_len=max_len, reuse_decode_kv=reuse_decode_kv,
                          share_prefix_reads=share_prefix_reads, **options)
    return start_engine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), config, adapters)


def _params(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


def test_mixed_batch_equals_each_request_alone(micro_model_dir: Path) -> None:
    tenants = {"a": 1, "b": 2, "c": 3}
    jobs = [(name, seed) for name in [*tenants, None] for seed in (10, 11)]
    engine, _ = _engine(micro_model_dir, num_rows=8, adapters=tenants)
    try:
        futures = [engine.submit(PROMPT, name, _params(seed)) for name, seed in jobs]
        mixed = [f.result(timeout=60).token_ids for f in futures]
    finally:
        engine.shutdown()
    by_adapter = {name: mixed[i] for i, (name, seed) in enumerate(jobs) if seed == 10}
    assert len({tuple(tokens) for tokens in by_adapter.values()}) == 4, "tenants' samples must differ"
    alone_engine, _ = _engine(micro_model_dir, num_rows=8, adapters=tenants)
    try:
        for (name, seed), tokens in zip(jobs, mixed):
            assert alone_engine.submit(PROMPT, name, _params(seed)).result(timeout=60).token_ids == tokens
    finally:
        alone_engine.shutdown()


def test_running_rows_decode_packed_at_the_front_whatever_cache_rows_they_hold(micro_model_dir: Path) -> None:
    """33 requests take cache rows 0-32; once the 32 short ones finish, the long one left in row 32 decodes in a
    batch of one row quantum (16 positions), not up to its row (48), and samples what it samples alone."""
    jobs = [("a" if i % 2 else "b", 100 + i, 2) for i in range(32)] + [("a", 7, 12)]
    engine, _ = _engine(micro_model_dir, num_rows=40, adapters={"a": 1, "b": 2}, max_prefills_per_step=40)
    runner = engine.engine.runner
    spans: list[int] = []
    decode = runner.decode
    runner.decode = lambda span: spans.append(span) or decode(span)
    try:
        engine.pause()  # the requests reach the engine together: rows in submission order
        futures = [engine.submit(PROMPT, name, _params(seed, max_tokens)) for name, seed, max_tokens in jobs]
        engine.resume()
        results = [future.result(timeout=120) for future in futures]
    finally:
        engine.shutdown()
    assert len({tuple(r.token_ids) for r in results}) > 1, "the requests' samples must differ"
    assert max(spans) == 48 and spans[-1] == 16  # 33 rows running, then the long one alone
    alone_engine, _ = _engine(micro_model_dir, num_rows=40, adapters={"a": 1, "b": 2})
    try:
        alone = alone_engine.submit(PROMPT, "a", _params(7, 12)).result(timeout=60)
    finally:
        alone_engine.shutdown()
    assert (alone.token_ids, alone.logprobs) == (results[-1].token_ids, results[-1].logprobs)


def test_requests_arriving_while_rows_decode_share_one_prefill_and_sample_the_same(micro_model_dir: Path) -> None:
    """With ``prefill_wait_steps`` far off, a request arriving while a row decodes waits until
    ``max_prefills_per_step`` requests wait and they are prefilled in one pass; each samples what it samples
    without waiting."""
    tenants = {"a": 1, "b": 2}
    outputs, rounds = [], []
    for wait in (0, 10_000):
        engine, _ = _engine(micro_model_dir, num_rows=8, adapters=tenants, max_prefills_per_step=2,
                            prefill_wait_steps=wait)
        try:
            long = engine.submit(PROMPT, "a", _params(1, max_tokens=70))
            late = []
            for i, name in enumerate(tenants):  # a few decode steps apart
                steps = engine.stats.decode_steps
                while engine.stats.decode_steps < steps + 3:
                    time.sleep(0.001)
                late.append(engine.submit(PROMPT[:7 + i], name, _params(i)))
            outputs.append([f.result(timeout=60).token_ids for f in [long, *late]])
            rounds.append(engine.stats.prefill_rounds)
        finally:
            engine.shutdown()
    assert outputs[0][1] != outputs[0][2], "tenants' samples must differ"
    assert len(outputs[0][0]) == 70, "the long request ran past both late ones' arrival"
    assert outputs[1] == outputs[0]
    assert rounds == [3, 2], "without waiting a prefill each; waiting, the long request's, then one for both late ones"


def test_requests_that_stop_early_and_those_taking_their_rows_match_the_hf_forward(micro_model_dir: Path) -> None:
    """A decode step is launched before the tokens of the step before it are read back: its rows take their input
    tokens from the device, and a row that drew a stop token runs once more (that token is dropped) while the
    request admitted into its row next is prefilled; a prefill's first tokens are read back after the next decode
    step is launched, its rows taking their input from the device too (those whose first token ends them run
    once more). 40 requests through 16 rows, finishing at varied steps by stop token or by length (a length of 1
    included): every log-prob is the HF forward's over the prompt and the tokens sampled before it, and each
    completion equals the request run alone."""
    stops = tuple(range(3, 400, 5))  # one token in five stops a completion
    jobs = [(name, seed) for seed in range(10) for name in ("a", "b", "c", None)]
    prompts = {seed: PROMPT[: 12 + seed % 3 * 4] for seed in range(10)}  # some rows share a cached prompt block

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=1 if seed == 4 else 10, temperature=1.0, seed=seed, stop_token_ids=stops)

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    routing, layers = attach_engine_lora(model, num_slots=4, max_rank=8)
    engine = EngineThread(Engine(model, layers, EngineConfig(num_rows=16, max_len=96, share_prefix_reads=True)))
    try:
        for name, seed in {"a": 1, "b": 2, "c": 3}.items():
            engine.register_adapter(name, random_adapter(layers, seed))
        engine.pause()  # the requests reach the engine together
        futures = [engine.submit(prompts[seed], name, params(seed)) for name, seed in jobs]
        engine.resume()
        mixed = [future.result(timeout=60) for future in futures]
        slots = {name: engine.engine.adapters.slot(name) for name in "abc"} | {None: -1}
    finally:
        engine.shutdown()
    assert len({tuple(c.token_ids) for c, (_, seed) in zip(mixed, jobs) if seed == 0}) == 4, "tenants' samples must differ"
    assert {c.finish_reason for c in mixed} == {"stop", "length"} and len({len(c.token_ids) for c in mixed}) >= 5
    firsts = [c.finish_reason for c in mixed if len(c.token_ids) == 1]
    assert {"stop", "length"} <= set(firsts), "requests must end at their prefill's token, by both reasons"
    assert all((c.token_ids[-1] in stops) == (c.finish_reason == "stop") for c in mixed)
    for (name, seed), completion in zip(jobs, mixed):
        ids = torch.tensor(prompts[seed] + completion.token_ids)
        with torch.no_grad(), routing.route(torch.full((len(ids),), slots[name])):
            logits = model(input_ids=ids[None]).logits[0, len(prompts[seed]) - 1 : -1].float()
        want = torch.log_softmax(logits, dim=-1).gather(1, ids[len(prompts[seed]):, None])[:, 0]
        assert torch.allclose(torch.tensor(completion.logprobs), want, atol=1e-4), (name, seed)
    alone_engine, _ = _engine(micro_model_dir, num_rows=16, adapters={"a": 1, "b": 2, "c": 3}, share_prefix_reads=True)
    try:
        for (name, seed), completion in zip(jobs, mixed):
            alone = alone_engine.submit(prompts[seed], name, params(seed)).result(timeout=60)
            assert (alone.token_ids, alone.logprobs, alone.finish_reason) == (
                completion.token_ids, completion.logprobs, completion.finish_reason)
    finally:
        alone_engine.shutdown()


def _pause_after_first_decode_step(engine: EngineThread, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Makes the engine thread pause itself right after its first decode step; returns an event set then."""
    paused = threading.Event()
    decode = engine.engine._decode

    def decode_then_pause() -> None:
        decode()
        if not paused.is_set():
            engine.pause()
            paused.set()

    monkeypatch.setattr(engine.engine, "_decode", decode_then_pause)
    return paused


def test_publish_in_place_while_other_tenants_decode(micro_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """b's request is mid-decode (the engine paused itself after one step) when a's publish arrives; the publish
    applies before b's next step, without waiting for b, and b's tokens are those of an undisturbed run."""
    engine, weights = _engine(micro_model_dir, num_rows=4, adapters={"a": 1, "b": 2})
    try:
        undisturbed = engine.submit(PROMPT, "b", _params(5, max_tokens=60)).result(timeout=60)
        a_before = engine.submit(PROMPT, "a", _params(6)).result(timeout=60)
        paused = _pause_after_first_decode_step(engine, monkeypatch)
        in_flight = engine.submit(PROMPT, "b", _params(5, max_tokens=60))
        assert paused.wait(timeout=60)
        publish = engine.publish("a", weights["b"], version=1)
        b_done_when_published: list[bool] = []
        publish.add_done_callback(lambda _: b_done_when_published.append(in_flight.done()))  # on the engine thread
        engine.resume()
        publish.result(timeout=60)
        assert b_done_when_published == [False], "a's publish must not wait for b's requests"
        after = in_flight.result(timeout=60)
        assert after.token_ids == undisturbed.token_ids and after.adapter_version == 0
        a_after = engine.submit(PROMPT, "a", _params(6)).result(timeout=60)
        assert a_after.adapter_version == 1 and a_after.token_ids != a_before.token_ids
    finally:
        engine.shutdown()


def test_publish_is_fenced_by_the_tenants_own_requests(micro_model_dir: Path) -> None:
    engine, weights = _engine(micro_model_dir, num_rows=4, adapters={"a": 1})
    try:
        reference = engine.submit(PROMPT, "a", _params(3, max_tokens=60)).result(timeout=60)
        running = engine.submit(PROMPT, "a", _params(3, max_tokens=60))
        while engine.stats.prefill_tokens + engine.stats.cached_prompt_tokens < 2 * len(PROMPT):
            time.sleep(0.001)
        publish = engine.publish("a", random_adapter(engine.engine.lora_layers, 9), version=1)
        queued = engine.submit(PROMPT, "a", _params(4))
        done = running.result(timeout=60)
        assert done.adapter_version == 0 and done.token_ids == reference.token_ids
        publish.result(timeout=60)
        assert queued.result(timeout=60).adapter_version == 1
    finally:
        engine.shutdown()


def test_engine_rejects_bad_requests(micro_model_dir: Path) -> None:
    engine, weights = _engine(micro_model_dir, num_rows=2, adapters={"a": 1})
    try:
        with pytest.raises(ValueError, match="unknown adapter"):
            engine.submit(PROMPT, "zzz", _params(0)).result(timeout=10)
        with pytest.raises(ValueError, match="max_len"):
            engine.submit(list(range(200)), "a", _params(0)).result(timeout=10)
        with pytest.raises(ValueError, match="already registered"):
            engine.register_adapter("a", weights["a"])
    finally:
        engine.shutdown()


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


def test_unregister_waits_for_running_requests_and_frees_the_slot(micro_model_dir: Path) -> None:
    engine, weights = _engine(micro_model_dir, num_rows=2, adapters={"a": 1})
    try:
        running = engine.submit(PROMPT, "a", _params(3, max_tokens=40))
        while engine.stats.prefill_tokens == 0:
            time.sleep(0.001)
        freed = engine.unregister_adapter("a")
        waiting = engine.submit(PROMPT, "a", _params(4))
        assert running.result(timeout=60).adapter_version == 0 and len(running.result().token_ids) == 40
        freed.result(timeout=60)
        with pytest.raises(ValueError, match="unregistered"):
            waiting.result(timeout=10)
        with pytest.raises(ValueError, match="unknown adapter"):
            engine.submit(PROMPT, "a", _params(0)).result(timeout=10)
        engine.register_adapter("b", weights["a"])  # the freed slot is reusable
        assert engine.submit(PROMPT, "b", _params(1)).result(timeout=60).adapter_version == 0
    finally:
        engine.shutdown()


def test_prefix_cache_reuses_blocks_bit_identically(micro_model_dir: Path) -> None:
    long_prompt = [(7 * i) % 300 + 5 for i in range(150)]
    engine, weights = _engine(micro_model_dir, num_rows=4, adapters={"a": 1, "b": 2}, max_len=256)
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    routing, layers = attach_engine_lora(model, num_slots=4, max_rank=8)
    uncached = EngineThread(Engine(model, layers, EngineConfig(num_rows=4, max_len=256, cache_prefixes=False)))
    uncached.register_adapter("a", weights["a"])
    try:
        first = engine.submit(long_prompt, "a", _params(1, max_tokens=16)).result(timeout=60)
        assert engine.stats.cached_prompt_tokens == 0
        again = engine.submit(long_prompt, "a", _params(2, max_tokens=16)).result(timeout=60)
        block = engine.engine.runner.block_size
        cacheable = (len(long_prompt) - 1) // block * block
        assert engine.stats.cached_prompt_tokens == cacheable, "every whole block but the last comes from the cache"
        other = engine.submit(long_prompt, "b", _params(2, max_tokens=16)).result(timeout=60)
        assert engine.stats.cached_prompt_tokens == cacheable, "another adapter never reuses a's blocks"
        assert other.token_ids != again.token_ids
        reference = uncached.submit(long_prompt, "a", _params(2, max_tokens=16)).result(timeout=60)
        assert again.token_ids == reference.token_ids and again.logprobs == reference.logprobs
        assert first.token_ids != again.token_ids  # different seeds, same prompt
        engine.publish("a", weights["b"], version=1).result(timeout=60)
        engine.submit(long_prompt, "a", _params(2, max_tokens=16)).result(timeout=60)
        assert engine.stats.cached_prompt_tokens == cacheable, "a publish drops the adapter's cached blocks"
    finally:
        engine.shutdown()
        uncached.shutdown()


def test_the_next_turn_computes_only_its_new_tokens_with_reuse_decode_kv(micro_model_dir: Path) -> None:
    """A finished turn's history serves the next turn of its episode, which then computes only the
    observation and the last sampled token; the completions match an engine that recomputes everything."""
    observation = [40, 41, 42, 43, 44]
    reusing, weights = _engine(micro_model_dir, num_rows=4, adapters={"a": 1, "b": 2}, reuse_decode_kv=True)
    plain, _ = _engine(micro_model_dir, num_rows=4, adapters={"a": 1, "b": 2})
    try:
        def episode(engine: EngineThread, adapter: str) -> list:
            first = engine.submit(PROMPT, adapter, _params(1)).result(timeout=60)
            computed = engine.stats.prefill_tokens
            second = engine.submit(PROMPT + first.token_ids + observation, adapter, _params(2)).result(timeout=60)
            return [first, second, engine.stats.prefill_tokens - computed]

        a_reused, a_plain = episode(reusing, "a"), episode(plain, "a")
        b_reused = episode(reusing, "b")
        assert a_reused[0].token_ids != b_reused[0].token_ids, "the adapters must sample differently"
        assert a_reused[2] == len(observation) + 1, "only the observation and the last sampled token are computed"
        assert a_plain[2] == len(PROMPT) + 12 + len(observation) - 16, "without reuse only the prompt's block is cached"
        for reused, recomputed in zip(a_reused[:2], a_plain[:2]):
            assert reused.token_ids == recomputed.token_ids
            assert torch.allclose(torch.tensor(reused.logprobs), torch.tensor(recomputed.logprobs), atol=1e-4)
        reusing.publish("a", weights["b"], version=1).result(timeout=60)
        computed = reusing.stats.prefill_tokens
        again = PROMPT + a_reused[0].token_ids + observation + a_reused[1].token_ids + observation
        reusing.submit(again, "a", _params(3)).result(timeout=60)
        assert reusing.stats.prefill_tokens - computed == len(again), "a new version never reuses the old one's K/V"
    finally:
        reusing.shutdown()
        plain.shutdown()


class _RecordingInbox(queue.Queue):
    """An inbox whose blocking gets wait for an item however long (no time-out), recording for each whether the
    engine was paused when it began; ``entered`` is set at every blocking get."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine
        self.waits: list[bool] = []
        self.entered = threading.Event()

    def get(self, block: bool = True, timeout: float | None = None):
        if block:
            self.waits.append(self.engine._paused.is_set())
            self.entered.set()
            return super().get(block=True, timeout=None)
        return super().get(block=False)


def test_a_pause_ends_an_idle_wait_and_the_engine_then_waits_paused(micro_model_dir: Path) -> None:
    """The engine thread waits for work when idle; the first pause ends that wait, so the time from then on is
    spent (and counted) in a paused wait, which the resume ends (the train scheduler pauses an idle engine at
    every N=1 pass)."""
    engine, _ = _engine(micro_model_dir, num_rows=4, adapters={"a": 1})
    try:
        inbox = _RecordingInbox(engine)
        engine._inbox = inbox  # the thread takes it at its next wait (its current one times out)
        assert inbox.entered.wait(timeout=60) and inbox.waits == [False]
        inbox.entered.clear()
        engine.pause()
        assert inbox.entered.wait(timeout=60) and inbox.waits == [False, True]
        inbox.entered.clear()
        engine.resume()
        assert inbox.entered.wait(timeout=60) and inbox.waits == [False, True, False]
    finally:
        engine.shutdown()


def test_pauses_nest_and_an_unmatched_resume_is_an_error(micro_model_dir: Path) -> None:
    engine, _ = _engine(micro_model_dir, num_rows=4, adapters={"a": 1})
    try:
        engine.pause()
        engine.pause()  # the train scheduler's pause inside a caller's
        future = engine.submit(PROMPT, "a", _params(0, max_tokens=3))
        engine.resume()
        time.sleep(0.3)
        assert not future.done() and engine.stats.decode_steps == 0, "one pause is still held"
        engine.resume()
        assert len(future.result(timeout=60).token_ids) == 3
        with pytest.raises(RuntimeError, match="resume\\(\\) without a pause"):
            engine.resume()
    finally:
        engine.shutdown()


def test_a_pause_mid_decode_accepts_the_step_in_flight_and_launches_nothing(micro_model_dir: Path) -> None:
    """Pausing while rows decode: the step in flight (launched before the last one's tokens were read) finishes
    and is accepted, no step is launched or accepted while paused, and after the resume every completion equals
    the same request run without a pause."""
    jobs = [(name, seed) for name in "ab" for seed in range(3)]
    engine, _ = _engine(micro_model_dir, num_rows=16, adapters={"a": 1, "b": 2}, max_len=400)
    try:
        futures = [engine.submit(PROMPT, name, _params(seed, max_tokens=300)) for name, seed in jobs]
        deadline = time.monotonic() + 60
        while engine.stats.decode_steps < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.pause()
        time.sleep(0.2)  # the loop sees the pause after the iteration it is in
        steps, tokens = engine.stats.decode_steps, engine.stats.generated_tokens
        time.sleep(0.3)
        assert (engine.stats.decode_steps, engine.stats.generated_tokens) == (steps, tokens), "it stepped while paused"
        assert not engine.engine.has_step_in_flight(), "the step in flight was not accepted before the pause"
        assert 5 <= steps < 300 and not any(future.done() for future in futures)
        engine.resume()
        paused = [future.result(timeout=60).token_ids for future in futures]
    finally:
        engine.shutdown()
    assert len({tuple(tokens) for tokens in paused}) == len(jobs), "samples must differ"
    alone_engine, _ = _engine(micro_model_dir, num_rows=16, adapters={"a": 1, "b": 2}, max_len=400)
    try:
        for (name, seed), tokens in zip(jobs, paused):
            assert alone_engine.submit(PROMPT, name, _params(seed, max_tokens=300)).result(timeout=60).token_ids == tokens
    finally:
        alone_engine.shutdown()


def test_requests_sharing_only_cached_blocks_are_admitted_together(micro_model_dir: Path) -> None:
    """The samples of a GRPO group wait one round for their shared uncached prompt; the next turns of the
    group's episodes (the prompt cached, the histories their own) are admitted in one round."""
    prompt = [(7 * i) % 300 + 5 for i in range(40)]  # two whole blocks and a part
    engine, _ = _engine(micro_model_dir, num_rows=8, adapters={"a": 1})
    try:
        engine.pause()  # the requests reach the engine together
        group = [engine.submit(prompt, "a", _params(seed, max_tokens=4)) for seed in range(4)]
        engine.resume()
        outputs = [future.result(timeout=60).token_ids for future in group]
        assert len({tuple(tokens) for tokens in outputs}) == 4, "the samples must differ"
        assert engine.stats.prefill_rounds == 2, "one sample computes the prompt, the other three reuse it"
        assert engine.stats.cached_prompt_tokens == 3 * 32
        engine.pause()
        turns = [engine.submit(prompt + tokens, "a", _params(10 + i, max_tokens=4)) for i, tokens in enumerate(outputs)]
        engine.resume()
        for future in turns:
            future.result(timeout=60)
        assert engine.stats.prefill_rounds == 3, "histories that share only cached blocks are not held back"
        assert engine.stats.cached_prompt_tokens == 3 * 32 + 4 * 32
    finally:
        engine.shutdown()


def test_rows_sharing_a_cached_prompt_read_one_copy_with_the_same_results(micro_model_dir: Path) -> None:
    """Two tenants' GRPO groups of one prompt, two turns each (histories reused): decode attention reads the
    group's copied prompt positions from one row (never across tenants, whose K/V differ), and every token
    and log-prob equals an engine where each row reads its own copy."""
    prompt = [(7 * i) % 300 + 5 for i in range(40)]  # two whole blocks and a part
    engines = [_engine(micro_model_dir, num_rows=16, adapters={"a": 1, "b": 2}, reuse_decode_kv=True,
                       share_prefix_reads=share)[0] for share in (True, False)]
    try:
        results = []
        for engine in engines:
            engine.pause()  # the requests reach the engine together
            firsts = [engine.submit(prompt, adapter, _params(seed, max_tokens=6)) for adapter in "ab" for seed in range(4)]
            engine.resume()
            firsts = [future.result(timeout=60) for future in firsts]
            engine.pause()
            seconds = [engine.submit(prompt + first.token_ids + [40, 41], adapter, _params(10 + i, max_tokens=6))
                       for i, (adapter, first) in enumerate(zip("aaaabbbb", firsts))]
            engine.resume()
            results.append([(c.token_ids, c.logprobs) for c in firsts + [future.result(timeout=60) for future in seconds]])
        assert len({tuple(tokens) for tokens, _ in results[0]}) == 16, "samples and tenants must differ"
        assert results[0] == results[1]
        assert engines[0].stats.shared_prefix_positions > 0 and engines[1].stats.shared_prefix_positions == 0
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_request_that_reaches_the_engine_after_its_adapter_left_fails_alone(micro_model_dir: Path) -> None:
    engine, _ = _engine(micro_model_dir, num_rows=4, adapters={"a": 1, "b": 2})
    try:
        running = engine.submit(PROMPT, "b", _params(1, max_tokens=40))
        engine.unregister_adapter("a").result(timeout=60)
        engine.pause()  # the request sits in the inbox, accepted by submit, as if it raced the unregister
        engine.engine.adapters.register("a")
        late = engine.submit(PROMPT, "a", _params(2))
        engine.engine.adapters.clear("a")
        engine.resume()
        with pytest.raises(ValueError, match="was unregistered"):
            late.result(timeout=60)
        assert len(running.result(timeout=60).token_ids) == 40
    finally:
        engine.shutdown()


def test_a_failing_prefill_fails_only_its_own_requests(micro_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = _engine(micro_model_dir, num_rows=4, adapters={"a": 1, "b": 2})
    try:
        running = engine.submit(PROMPT, "a", _params(1, max_tokens=40))
        while engine.stats.decode_steps == 0:
            time.sleep(0.001)

        def broken_prefill(jobs):
            raise RuntimeError("prefill broke")

        monkeypatch.setattr(engine.engine.runner, "prefill", broken_prefill)
        with pytest.raises(RuntimeError, match="prefill broke"):
            engine.submit(PROMPT, "b", _params(2)).result(timeout=60)
        assert len(running.result(timeout=60).token_ids) == 40
        monkeypatch.undo()
        assert len(engine.submit(PROMPT, "b", _params(2)).result(timeout=60).token_ids) == 12, "its row was freed"
    finally:
        engine.shutdown()


def test_prefill_and_decode_logits_match_the_hf_forward(micro_model_dir: Path) -> None:
    """The runner's own layer loop (fused-op references, slot KV cache) computes what the HF model computes."""
    from skyrl_clora.sampler.model_runner import ModelRunner, PrefillJob

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    routing, _ = attach_engine_lora(model, num_slots=2, max_rank=8)
    runner = ModelRunner(model, num_rows=16, max_len=64, block_size=16, prefill_tokens=64)
    tokens = torch.tensor(PROMPT + [3, 4, 5])
    prefill_logits = runner.prefill([PrefillJob(row=2, tokens=tokens[:-1], lora_slot=-1)])[0]
    runner.set_decode_inputs([0, 0, int(tokens[-1])] + [0] * 13, [0, 0, len(tokens) - 1] + [0] * 13, [-1] * 16)
    decode_logits = runner.decode(16)[2]
    with torch.no_grad():
        want = model(input_ids=tokens[None]).logits[0].float()
    assert torch.allclose(prefill_logits, want[-2], atol=1e-4), float((prefill_logits - want[-2]).abs().max())
    assert torch.allclose(decode_logits, want[-1], atol=1e-4), float((decode_logits - want[-1]).abs().max())
