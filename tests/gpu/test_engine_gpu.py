"""The embedded engine on the GPU: CUDA-graph decode against eager decode and the HF forward, graphed ragged
prefill passes against eager ones, mixed tenants, in-place publishes seen by graph replays. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.lora.layers import write_slot
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.model_runner import PrefillJob
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.helpers import random_adapter, start_engine

pytestmark = pytest.mark.gpu

PROMPT = list(range(7, 47))


def _model(dtype: torch.dtype) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen3ForCausalLM(config).to(dtype).eval()


def _engine(cuda_graphs: bool, tenants: dict[str, int], dtype: torch.dtype = torch.bfloat16,
            reuse_decode_kv: bool = False, kv_dtype: torch.dtype | None = None) -> EngineThread:
    config = EngineConfig(num_rows=32, max_len=128, block_size=32, cuda_graphs=cuda_graphs,
                          reuse_decode_kv=reuse_decode_kv, kv_dtype=kv_dtype)
    return start_engine(_model(dtype), config, tenants, max_rank=16, b_std=0.05)[0]


def _greedy(engine: EngineThread, adapter: str | None, max_tokens: int = 24) -> list[int]:
    return engine.submit(PROMPT, adapter, SamplingParams(max_tokens=max_tokens, temperature=0.0)).result(timeout=120).token_ids


def test_graph_replay_matches_eager_decode_for_mixed_tenants() -> None:
    tenants = {"a": 1, "b": 2, "c": 3}
    graphed, eager = _engine(True, tenants), _engine(False, tenants)
    try:
        assert graphed.engine.runner._graphs and not eager.engine.runner._graphs  # decode steps replay captured graphs
        jobs = [*tenants, None]
        replayed = [graphed.submit(PROMPT, name, SamplingParams(max_tokens=24, temperature=0.0)) for name in jobs]
        replayed = [future.result(timeout=120).token_ids for future in replayed]
        assert len({tuple(tokens) for tokens in replayed}) == len(jobs), "tenants' outputs must differ"
        assert replayed == [_greedy(eager, name) for name in jobs]
    finally:
        graphed.shutdown()
        eager.shutdown()


def test_an_fp8_kv_cache_replays_graphs_as_eager_steps_close_to_the_model_dtype_cache() -> None:
    """An fp8 (e4m3, scale 1.0) cache on the GPU's own fp8 conversions: graph replays give eager decode's tokens
    for mixed tenants, and each request's first greedy log-prob (from a prefill whose attention
    reads the prompt's K/V back rounded to e4m3) is within 0.05 nats of the bf16-cache engine's (the CPU test's
    bound, tests/sampler/test_engine_paged.py)."""
    tenants = {"a": 1, "b": 2, "c": 3}
    fp8 = torch.float8_e4m3fn
    graphed, eager, plain = _engine(True, tenants, kv_dtype=fp8), _engine(False, tenants, kv_dtype=fp8), _engine(True, tenants)

    def greedy(engine: EngineThread, adapter: str | None):
        return engine.submit(PROMPT, adapter, SamplingParams(max_tokens=24, temperature=0.0)).result(timeout=120)

    try:
        assert graphed.engine.runner.k_cache.dtype == fp8
        jobs = [*tenants, None]
        replayed = [greedy(graphed, name) for name in jobs]
        assert len({tuple(c.token_ids) for c in replayed}) == len(jobs), "tenants' outputs must differ"
        stepped = [greedy(eager, name) for name in jobs]
        assert [c.token_ids for c in replayed] == [c.token_ids for c in stepped]
        gaps = [abs(c.logprobs[0] - greedy(plain, name).logprobs[0]) for c, name in zip(replayed, jobs)]
        assert max(gaps) < 0.05, gaps
    finally:
        for engine in (graphed, eager, plain):
            engine.shutdown()


def test_the_next_turn_reuses_the_decoded_history() -> None:
    """With reuse_decode_kv the second turn of an episode computes only its observation and the last sampled
    token; in fp32 its greedy completion equals that of an engine that recomputes the whole prompt."""
    observation = [300, 301, 302, 303, 304]
    reusing = _engine(True, {"a": 1, "b": 2}, torch.float32, reuse_decode_kv=True)
    plain = _engine(True, {"a": 1, "b": 2}, torch.float32)
    try:
        turns = {}
        for engine in (reusing, plain):
            for name in ("a", "b"):
                first = _greedy(engine, name)
                computed = engine.stats.prefill_tokens
                second = engine.submit(PROMPT + first + observation, name,
                                       SamplingParams(max_tokens=24, temperature=0.0)).result(timeout=120).token_ids
                turns[engine is reusing, name] = (first, second, engine.stats.prefill_tokens - computed)
        assert turns[True, "a"][0] != turns[True, "b"][0], "tenants' outputs must differ"
        for name in ("a", "b"):
            assert turns[True, name][2] == len(observation) + 1
            assert turns[False, name][2] > 24 + len(observation)
            assert turns[True, name][:2] == turns[False, name][:2]
    finally:
        reusing.shutdown()
        plain.shutdown()


def test_publish_in_place_is_seen_by_graph_replays() -> None:
    engine = _engine(True, {"a": 1, "b": 2})
    reference = _engine(True, {"a": 2})
    try:
        before = _greedy(engine, "a")
        new_weights = random_adapter(engine.engine.lora_layers, 2, b_std=0.05)
        engine.publish("a", new_weights, version=1).result(timeout=60)
        after = _greedy(engine, "a")
        assert after != before and after == _greedy(reference, "a")
    finally:
        engine.shutdown()
        reference.shutdown()


def test_requests_that_stop_early_match_the_hf_forward() -> None:
    """Decode steps are launched before the tokens of the step before them reach the host (their rows' input
    tokens stay on the GPU; a row that drew a stop token runs once more). fp32 graphs, shared prefix reads and
    reused histories, 80 first turns and their second turns through 32 rows, finishing at varied steps: every
    log-prob is the HF forward's over the prompt and the tokens sampled before it."""
    model = _model(torch.float32)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # weights large enough that a wrong input token moves the log-probs visibly
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.05, generator=generator)
    routing, layers = attach_engine_lora(model, num_slots=4, max_rank=16)
    engine = EngineThread(Engine(model, layers, EngineConfig(num_rows=32, max_len=128, block_size=32, share_prefix_reads=True,
                                                             reuse_decode_kv=True)))
    stops = tuple(range(3, 512, 5))  # one token in five stops a completion
    jobs = [(name, seed) for seed in range(20) for name in ("a", "b", "c", None)]

    def run(prompts: list[list[int]]) -> list:
        engine.pause()  # the requests reach the engine together
        futures = [engine.submit(prompt, name, SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                               stop_token_ids=stops))
                   for prompt, (name, seed) in zip(prompts, jobs)]
        engine.resume()
        return [future.result(timeout=120) for future in futures]

    try:
        for name, seed in {"a": 1, "b": 2, "c": 3}.items():
            engine.register_adapter(name, random_adapter(layers, seed, b_std=0.05))
        firsts_prompts = [PROMPT[: 34 + seed % 3 * 3] for _, seed in jobs]  # one cached block shared by all
        firsts = run(firsts_prompts)
        slots = {name: engine.engine.adapters.slot(name) for name in "abc"} | {None: -1}  # taken at first use
        seconds_prompts = [prompt + first.token_ids + [300, 301] for prompt, first in zip(firsts_prompts, firsts)]
        seconds = run(seconds_prompts)
    finally:
        engine.shutdown()
    assert len({tuple(c.token_ids) for c, (_, seed) in zip(firsts, jobs) if seed == 0}) == 4, "tenants' samples must differ"
    assert {c.finish_reason for c in firsts + seconds} == {"stop", "length"}
    assert engine.stats.cached_prompt_tokens > 0 and engine.stats.shared_prefix_positions > 0
    worst = 0.0
    for prompt, completion, (name, _) in zip(firsts_prompts + seconds_prompts, firsts + seconds, jobs + jobs):
        ids = torch.tensor(prompt + completion.token_ids, device="cuda")
        with torch.no_grad(), routing.route(torch.full((len(ids),), slots[name], device="cuda")):
            logits = model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1].float()
        want = torch.log_softmax(logits, dim=-1).gather(1, ids[len(prompt):, None])[:, 0]
        worst = max(worst, float((torch.tensor(completion.logprobs, device="cuda") - want).abs().max()))
    assert worst < 2e-2, worst


def test_decode_logits_match_the_hf_forward() -> None:
    engine = _engine(True, {}, dtype=torch.float32)
    engine.shutdown()  # drive the runner directly, row 0 holding the blocks of the prompt's positions
    runner, blocks = engine.engine.runner, engine.engine.scheduler.blocks
    blocks.grow(0, -(-len(PROMPT) // runner.block_size))
    runner.set_block_tables(blocks.tables)
    tokens = torch.tensor(PROMPT, device="cuda")
    runner.prefill([PrefillJob(row=0, tokens=tokens[:-1], lora_slot=-1)])
    runner.set_decode_inputs([PROMPT[-1]] + [0] * 15, [len(PROMPT) - 1] + [0] * 15, [-1] * 16)
    logits = runner.decode(16)[0]
    with torch.no_grad():
        want = runner.model(input_ids=tokens[None]).logits[0, -1].float()
    assert torch.allclose(logits, want, atol=2e-3, rtol=1e-3), float((logits - want).abs().max())


def test_graphed_prefill_passes_match_eager_ones() -> None:
    """Ragged prefill passes replayed from CUDA graphs (each flat-batch size captured on its first use, then
    replayed with other jobs) give the logits and K/V of eager passes, for mixed tenants and starts."""
    from skyrl_clora.sampler.model_runner import ModelRunner

    model = _model(torch.float32)
    routing, layers = attach_engine_lora(model, num_slots=4, max_rank=16)
    for slot, seed in ((0, 1), (1, 2)):
        write_slot(layers, slot, random_adapter(layers, seed, b_std=0.05))
    runners = [ModelRunner(model, num_rows=16, max_len=128, block_size=16, prefill_tokens=128) for _ in range(2)]
    runners[0].prefill_graphs = True  # no decode graphs needed here
    rounds = [
        [(0, PROMPT, 0, 0), (1, PROMPT[:23], 1, 5), (2, PROMPT[:9], -1, 0)],  # 69 positions: size 128, captured
        [(3, PROMPT[3:], 1, 0), (4, PROMPT, 0, 32), (5, PROMPT[:17], 0, 16)],  # 47 positions: size 64, captured
        [(6, PROMPT, 1, 0), (7, PROMPT[::-1], 0, 0)],  # 80 positions: size 128, replayed with other jobs
    ]
    for jobs in rounds:
        for row, tokens, slot, start in jobs:
            if start:  # the positions before start: an earlier eager pass of the same tokens, in both runners
                runners[1].prefill([PrefillJob(row, torch.tensor(tokens[:start], device="cuda"), slot)])
                runners[0].write_kv(row, 0, runners[1].read_kv(row, 0, start))
        graphed, eager = [runner.prefill([PrefillJob(row, torch.tensor(tokens, device="cuda"), slot, start)
                                          for row, tokens, slot, start in jobs]) for runner in runners]
        assert not torch.allclose(graphed[0], graphed[1]), "jobs' logits must differ"
        for got, want in zip(graphed, eager):
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())
        for row, tokens, _, _ in jobs:
            got, want = runners[0].read_kv(row, 0, len(tokens)), runners[1].read_kv(row, 0, len(tokens))
            assert all(torch.allclose(g, w, atol=1e-4, rtol=1e-4) for g, w in zip(got, want))
    assert sorted(runners[0]._prefill_graphs) == [64, 128]


@pytest.mark.parametrize("reserve_kv", [True, False])
def test_a_small_block_pool_completes_every_request_preempting_only_without_reservations(reserve_kv: bool) -> None:
    """On a pool of 12 blocks of 32 positions, 24 long-tailed single-turn requests over two tenants (graphs on) do
    not fit at once: admitted by their prompts alone some are preempted and start over; reserving their blocks to
    finish, none is; either way every one completes with its full length, and every block goes back to the pool.
    Finished turns keep no history (``reuse_decode_kv=False``): kept ones would hold blocks from fresh requests
    for ``HISTORY_GRACE_STEPS`` decode steps and so throttle admission below what makes rows outgrow the pool."""
    model = _model(torch.bfloat16)
    routing, layers = attach_engine_lora(model, num_slots=4, max_rank=16)
    engine = EngineThread(Engine(model, layers, EngineConfig(num_rows=32, max_len=256, block_size=32, num_blocks=12,
                                                             reuse_decode_kv=False, share_prefix_reads=True,
                                                             reserve_kv=reserve_kv)))
    for name, seed in (("a", 1), ("b", 2)):
        engine.register_adapter(name, random_adapter(layers, seed, b_std=0.05))
    lengths = [min(200, 8 * (1 + i % 7) ** 2 // 3) for i in range(24)]
    try:
        futures = [engine.submit(PROMPT, "ab"[i % 2], SamplingParams(max_tokens=n, temperature=1.0, seed=i))
                   for i, n in enumerate(lengths)]
        results = [future.result(timeout=300) for future in futures]
    finally:
        engine.shutdown()
    assert [len(r.token_ids) for r in results] == lengths
    assert (engine.stats.preemptions == 0) if reserve_kv else (engine.stats.preemptions > 0)
    assert engine.engine.scheduler.blocks.held_blocks() == 0


def test_gpu_intervals_are_ordered_host_clock_spans_of_the_engines_passes() -> None:
    """``record_gpu_intervals``: every decode step's and prefill round's GPU interval, on the host clock, within
    the calls that ran them, one engine stream's intervals never overlapping."""
    import time

    engine = _engine(True, {"a": 1})
    try:
        timeline = engine.record_gpu_intervals()
        started = time.perf_counter()
        _greedy(engine, "a")
        finished = time.perf_counter()
        spans = timeline.intervals
        assert len(spans) >= 2 and engine.stats.decode_steps > 0
        assert all(started - 1e-3 <= lo <= hi <= finished + 1e-3 for lo, hi in spans)
        ordered = sorted(spans)
        assert all(a_hi <= b_lo + 1e-5 for (_, a_hi), (b_lo, _) in zip(ordered, ordered[1:]))
    finally:
        engine.shutdown()
