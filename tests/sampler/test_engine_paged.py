"""The engine (skyrl_clora.sampler.engine) on a small KV block pool: long-tailed requests that do not all fit at once
wait for blocks or are preempted and start over, and still complete exactly as on a pool with room for all; a request
longer than the whole pool fails alone; shared prompt blocks are held by reference (no copies) and go back to the
pool."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.helpers import start_engine

BLOCK = 16


def _engine(model_dir: Path, num_blocks: int | None, reuse_decode_kv: bool = False,
            kv_dtype: torch.dtype | None = None, reserve_kv: bool = True) -> EngineThread:
    config = EngineConfig(num_rows=16, max_len=160, block_size=BLOCK, num_blocks=num_blocks,
                          reuse_decode_kv=reuse_decode_kv, kv_dtype=kv_dtype, reserve_kv=reserve_kv)
    return start_engine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), config, {"a": 1, "b": 2})[0]


def _jobs() -> list[tuple[list[int], str, SamplingParams]]:
    """24 requests over two tenants: groups of 4 samples sharing a 40-token prompt, long-tailed lengths."""
    rng = random.Random(0)
    jobs = []
    for group in range(6):
        prompt = [5 + (group * 37 + i * 11) % 290 for i in range(40)]
        for sample in range(4):
            length = min(100, max(1, round(rng.lognormvariate(3.0, 1.0))))
            jobs.append((prompt, "ab"[group % 2], SamplingParams(max_tokens=length, temperature=1.0, seed=group * 10 + sample)))
    return jobs


def _run(engine: EngineThread, jobs: list) -> list:
    try:
        futures = [engine.submit(prompt, adapter, params) for prompt, adapter, params in jobs]
        return [future.result(timeout=120) for future in futures]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("reserve_kv", [True, False])
def test_a_small_pool_completes_exactly_as_a_large_one_preempting_only_without_reservations(
        micro_model_dir: Path, reserve_kv: bool) -> None:
    """24 blocks of 16 tokens hold a few rows at a time (a row holds up to 9). Reserving each request's blocks to
    finish, admission never over-commits the pool: no preemption, fewer rows at once; admitting by prompt alone,
    running rows outgrow the pool and are preempted. Either way every request samples what it samples in a roomy
    pool."""
    jobs = _jobs()
    roomy = _engine(micro_model_dir, num_blocks=None, reserve_kv=reserve_kv)
    expected = _run(roomy, jobs)
    assert len({tuple(c.token_ids) for c in expected}) == len(jobs), "the requests' samples must differ"
    assert roomy.stats.preemptions == 0 and roomy.stats.peak_running_rows == 16
    small = _engine(micro_model_dir, num_blocks=24, reserve_kv=reserve_kv)
    got = _run(small, jobs)
    if reserve_kv:
        assert small.stats.preemptions == 0 and 1 < small.stats.peak_running_rows < 16
    else:
        assert small.stats.preemptions > 0, "the small pool must have preempted to test anything"
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]
    assert small.engine.scheduler.blocks.held_blocks() == 0, "every block went back to the pool"


def test_shared_prompt_blocks_are_held_by_reference(micro_model_dir: Path) -> None:
    engine = _engine(micro_model_dir, num_blocks=None)
    prompt = list(range(5, 53))  # three whole blocks
    try:
        first = engine.submit(prompt, "a", SamplingParams(max_tokens=4, seed=1)).result(timeout=60)
        assert first.token_ids
        blocks = engine.engine.scheduler.blocks.lookup("a", 0, prompt)
        assert len(blocks) == 3 and engine.engine.scheduler.blocks.held_blocks() == 0, "keyed, held by nothing once it finished"
        futures = [engine.submit(prompt + [7], "a", SamplingParams(max_tokens=30, seed=s)) for s in range(4)]
        results = [f.result(timeout=60) for f in futures]
        assert len({tuple(r.token_ids) for r in results}) == 4
        assert engine.stats.cached_prompt_tokens == 4 * 48
        assert engine.stats.peak_blocks_held <= 3 + 4 * 3, "the siblings share the prompt's three blocks"
    finally:
        engine.shutdown()


def test_a_request_longer_than_the_pool_fails_alone(micro_model_dir: Path) -> None:
    engine = _engine(micro_model_dir, num_blocks=4)  # 64 positions in all
    try:
        too_long = engine.submit(list(range(5, 75)), "a", SamplingParams(max_tokens=4, seed=1))
        grows_too_long = engine.submit(list(range(5, 25)), "b", SamplingParams(max_tokens=120, seed=2))
        fits = engine.submit(list(range(5, 25)), "a", SamplingParams(max_tokens=8, seed=3))
        with pytest.raises(MemoryError, match="sampler.gpu_memory_utilization"):
            too_long.result(timeout=60)
        with pytest.raises(MemoryError, match="KV blocks"):
            grows_too_long.result(timeout=60)
        assert len(fits.result(timeout=60).token_ids) == 8
    finally:
        engine.shutdown()


def test_a_failed_prefill_fails_its_requests_and_gives_their_blocks_back(micro_model_dir: Path) -> None:
    engine = _engine(micro_model_dir, num_blocks=None)
    prefill = engine.engine.runner.prefill
    calls = []

    def fails_once(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("prefill broke")
        return prefill(jobs)

    engine.engine.runner.prefill = fails_once
    try:
        broken = engine.submit(list(range(5, 45)), "a", SamplingParams(max_tokens=4, seed=1))
        with pytest.raises(RuntimeError, match="prefill broke"):
            broken.result(timeout=60)
        assert engine.engine.scheduler.blocks.held_blocks() == 0, "the failed request's blocks went back to the pool"
        assert len(engine.submit(list(range(5, 45)), "b", SamplingParams(max_tokens=4, seed=2)).result(timeout=60).token_ids) == 4
    finally:
        engine.shutdown()


def test_an_fp8_cache_serves_mixed_tenants_close_to_the_model_dtype_cache(micro_model_dir: Path) -> None:
    """An fp8 (e4m3, scale 1.0) cache: the tenants' greedy samples differ; a small pool that preempts gives the
    roomy pool's tokens and log-probs exactly (the fp8 engine is as reproducible as the model-dtype one); and each
    request's first greedy token is the model-dtype engine's, its log-prob within 0.05 nats. The first token
    comes from the prefill, whose attention reads K/V rounded to e4m3's 3 mantissa bits (relative error
    <= 2**-4 per entry, vLLM's ``kv_cache_dtype=fp8`` without scales): the micro model's first log-probs move by
    at most 0.034 nats under it (measured), so 0.05 leaves room for other seeds while a cache corrupted wholesale
    (e.g. a wrong cast) moves them by whole nats."""
    jobs = [(prompt, adapter, SamplingParams(max_tokens=params.max_tokens, temperature=0.0, seed=params.seed))
            for prompt, adapter, params in _jobs()[:12]]
    wide = _run(_engine(micro_model_dir, num_blocks=None), jobs)
    roomy = _engine(micro_model_dir, num_blocks=None, kv_dtype=torch.float8_e4m3fn)
    assert roomy.engine.runner.k_cache.dtype == torch.float8_e4m3fn
    expected = _run(roomy, jobs)
    by_tenant = {adapter: tuple(c.token_ids) for (_, adapter, _), c in zip(jobs, expected)}
    assert by_tenant["a"] != by_tenant["b"], "the tenants' outputs must differ"
    small = _engine(micro_model_dir, num_blocks=12, kv_dtype=torch.float8_e4m3fn, reserve_kv=False)
    got = _run(small, jobs)
    assert small.stats.preemptions > 0, "the small pool must have preempted to test anything"
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]
    assert [c.token_ids[0] for c in expected] == [c.token_ids[0] for c in wide]
    gaps = [abs(c.logprobs[0] - w.logprobs[0]) for c, w in zip(expected, wide)]
    assert max(gaps) < 0.05, gaps
