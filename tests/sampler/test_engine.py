"""The embedded engine (skyrl_clora.sampler.engine): mixed-tenant continuous batching (every request samples what it
samples alone), rows packed at the front of the decode batch, batched prefills, decode steps launched before the
previous step's tokens are read, version-fenced in-place publishes and unregisters, the prefix cache and the reuse of
a finished turn's K/V, and failures that stay with their own requests."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.engine_driver import PROMPT
from tests.support.engine_threads import engine_on as _engine
from tests.support.engine_threads import seeded_params as _params
from tests.support.helpers import random_adapter


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
