"""The engine's thread (skyrl_clora.sampler.engine_thread): its thread-safe API refuses what the engine cannot take
(an unknown adapter, a prompt that leaves no room for a token, an adapter registered twice) before anything is
queued, publishes and unregisters land through its inbox, pauses nest and end an idle wait, a pause mid-decode
accepts the step in flight and launches nothing, a broken round fails its own requests and not the thread, and
shutdown stops the thread."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.support.engine_driver import PROMPT
from tests.support.engine_threads import engine_on as _engine
from tests.support.engine_threads import seeded_params as _params
from tests.support.helpers import random_adapter


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


def test_a_prompt_must_leave_room_for_one_token_and_be_non_empty(micro_model_dir: Path) -> None:
    """``max_len`` is the config's rounded up to whole blocks (90 -> 96): a prompt of 95 tokens samples its one
    token, one of 96 (or none) is refused by a future that already holds the error, never queued."""
    engine, _ = _engine(micro_model_dir, num_rows=2, adapters={"a": 1}, max_len=90)
    try:
        assert engine.max_len == 96
        longest = engine.submit(list(range(5, 100)), "a", _params(0, max_tokens=1)).result(timeout=60)
        assert len(longest.token_ids) == 1 and longest.finish_reason == "length"
        for prompt in (list(range(5, 101)), []):
            refused = engine.submit(prompt, "a", _params(0))
            assert refused.done()
            reason = f"prompt of {len(prompt)} tokens does not fit the engine's max_len 96"
            with pytest.raises(ValueError, match=reason):
                refused.result()
        assert engine._inbox.empty()
    finally:
        engine.shutdown()


def test_publishes_and_unregisters_of_an_unknown_adapter_fail_without_reaching_the_engine(
        micro_model_dir: Path) -> None:
    engine, weights = _engine(micro_model_dir, num_rows=2, adapters={"a": 1})
    try:
        published = engine.publish("nobody", weights["a"], version=1)
        dropped = engine.unregister_adapter("nobody")
        assert published.done() and dropped.done() and engine._inbox.empty()
        for future in (published, dropped):
            with pytest.raises(ValueError, match="unknown adapter 'nobody'"):
                future.result()
        with pytest.raises(ValueError, match=r"unknown adapter 'b'; registered: \['a'\]"):
            engine.submit(PROMPT, "b", _params(0)).result()
    finally:
        engine.shutdown()


def test_publish_register_and_unregister_land_through_the_inbox(micro_model_dir: Path) -> None:
    """A publish resolves once the engine applied it (the version and the weights it serves are the new ones); a
    registration at version 3 is served at 3; an unregister resolves once the adapter is gone."""
    engine, weights = _engine(micro_model_dir, num_rows=2, adapters={"a": 1})
    try:
        assert engine.adapter_version("a") == 0
        other = random_adapter(engine.engine.lora_layers, 7)
        engine.publish("a", other, version=1).result(timeout=60)
        assert engine.adapter_version("a") == 1
        served = engine.engine.adapters.read("a", other.rank, other.alpha)
        assert all(torch.equal(served.b[path], other.b[path]) for path in other.b)
        engine.register_adapter("b", weights["a"], version=3)
        assert engine.adapter_version("b") == 3
        assert engine.submit(PROMPT, "b", _params(1, max_tokens=2)).result(timeout=60).adapter_version == 3
        engine.unregister_adapter("b").result(timeout=60)
        assert "b" not in engine.engine.adapters
        with pytest.raises(KeyError):
            engine.adapter_version("b")
    finally:
        engine.shutdown()


def test_a_broken_decode_step_fails_its_requests_and_the_thread_serves_on(micro_model_dir: Path) -> None:
    """A round that raises fails the requests running then (the engine's ``fail``), frees their rows, and the thread
    goes on serving the next request; the counters and queue waits are the engine's own."""
    engine, _ = _engine(micro_model_dir, num_rows=2, adapters={"a": 1})
    runner = engine.engine.runner
    decode = runner.decode
    calls: list[int] = []

    def breaks_once(span: int) -> torch.Tensor:
        calls.append(span)
        if len(calls) == 1:
            raise RuntimeError("decode broke")
        return decode(span)

    runner.decode = breaks_once
    try:
        broken = engine.submit(PROMPT, "a", _params(1, max_tokens=5))
        with pytest.raises(RuntimeError, match="decode broke"):
            broken.result(timeout=60)
        served = engine.submit(PROMPT, "a", _params(2, max_tokens=5)).result(timeout=60)
        assert len(served.token_ids) == 5 and engine.running_rows() == 0
        assert engine.stats is engine.engine.stats and engine.stats.decode_steps >= 4
        assert engine.queue_waits()["a"]["requests"] == 1, "only the completed request is counted"
    finally:
        engine.shutdown()
    assert not engine._thread.is_alive()
