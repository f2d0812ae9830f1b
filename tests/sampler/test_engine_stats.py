"""The engine's counters (skyrl_clora.sampler.engine_stats): how :class:`StatsRecorder` turns the engine's events
into :class:`EngineStats` (steps, tokens, the split of a decode step's seconds, peaks, preemptions, the adapter slots'
hits, loads and evictions and their hit rate, busy / paused / idle waits), each tenant's queue-wait summary (the base
model's requests not counted), and GPU spans that time nothing off CUDA."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from skyrl_clora.sampler.engine_stats import EngineStats, GPUSpan, StatsRecorder

CPU = torch.device("cpu")


def test_the_adapter_hit_rate_is_hits_over_admissions_and_one_before_any() -> None:
    recorder = StatsRecorder(CPU)
    assert recorder.stats.adapter_hit_rate == 1.0
    recorder.adapters_scheduled(hits=3, loads=1, evictions=0)
    recorder.adapters_scheduled(hits=0, loads=4, evictions=3)
    stats = recorder.stats
    assert (stats.adapter_hits, stats.adapter_loads, stats.adapter_evictions) == (3, 5, 3)
    assert stats.adapter_hit_rate == 3 / 8
    assert EngineStats(adapter_loads=2).adapter_hit_rate == 0.0


def test_a_decode_step_splits_its_seconds_into_staging_launch_and_the_wait_for_its_tokens() -> None:
    recorder = StatsRecorder(CPU)
    recorder.decode_launched(started=10.0, staged=10.25, launched=11.0, shared_positions=48)
    recorder.decode_launched(started=20.0, staged=20.5, launched=20.75, shared_positions=16)
    stats = recorder.stats
    assert (stats.decode_steps, stats.shared_prefix_positions) == (2, 64)
    assert (stats.decode_input_seconds, stats.decode_launch_seconds, stats.decode_seconds) == (0.75, 1.0, 1.75)
    began = time.perf_counter()
    recorder.decode_accepted(began - 2.0, began - 0.5, GPUSpan(CPU))
    assert stats.decode_wait_seconds == pytest.approx(1.5) and stats.decode_gpu_seconds == 0.0
    assert stats.decode_seconds > 1.75 + 1.99, "a step's seconds run from its wait's start until now"
    assert recorder.timeline is None


def test_prefill_rounds_count_computed_and_cached_tokens_and_the_peaks_are_kept() -> None:
    recorder = StatsRecorder(CPU)
    now = time.perf_counter()
    recorder.prefill_launched(now - 1.0, computed=40, cached=32, held_blocks=9)
    recorder.prefill_launched(now - 3.0, computed=8, cached=0, held_blocks=5)
    recorder.prefill_accepted(now - 1.0, GPUSpan(CPU), GPUSpan(CPU))
    for running in (3, 7, 2):
        recorder.row_started(running)
    recorder.preempted(2)
    recorder.preempted(1)
    recorder.tokens_accepted(5, time.perf_counter())
    recorder.tokens_accepted(3, time.perf_counter())
    recorder.graphs_captured(1.5)
    stats = recorder.stats
    assert (stats.prefill_rounds, stats.prefill_tokens, stats.cached_prompt_tokens) == (2, 48, 32)
    assert (stats.peak_blocks_held, stats.peak_running_rows, stats.preemptions) == (9, 7, 3)
    assert stats.prefill_seconds > 4.99 and stats.prefill_gpu_seconds == stats.prefill_copy_gpu_seconds == 0.0
    assert (stats.generated_tokens, stats.graph_capture_seconds) == (8, 1.5)
    assert 0.0 <= stats.retire_seconds < 1.0


def test_waits_count_as_paused_idle_or_busy_and_only_idle_waits_of_a_millisecond_or_more_are_counted() -> None:
    recorder = StatsRecorder(CPU)
    recorder.waited(0.25, paused=True, idle=True)  # a pause wins over idle
    recorder.waited(0.5, paused=False, idle=True)
    recorder.waited(0.0005, paused=False, idle=True)
    recorder.waited(0.001, paused=False, idle=True)
    recorder.waited(3.0, paused=False, idle=False)  # neither: the wait of a busy loop counts nowhere
    recorder.busy(2.0)
    recorder.busy(0.5)
    stats = recorder.stats
    assert stats.paused_seconds == 0.25 and stats.idle_seconds == pytest.approx(0.5 + 0.0005 + 0.001)
    assert (stats.idle_waits, stats.longest_idle_seconds, stats.busy_seconds) == (2, 0.5, 2.5)


def test_queue_waits_summarise_each_tenants_finished_requests_sorted_by_tenant() -> None:
    recorder = StatsRecorder(CPU)
    assert recorder.queue_waits() == {}
    for wait in (4.0, 1.0, 3.0, 2.0):
        recorder.request_finished("b", wait)
    recorder.request_finished("a", 0.5)
    recorder.request_finished(None, 100.0)  # the base model: not a tenant
    waits = recorder.queue_waits()
    assert list(waits) == ["a", "b"]
    assert waits["a"] == {"requests": 1, "p50_s": 0.5, "p99_s": 0.5, "max_s": 0.5, "total_s": 0.5}
    assert waits["b"] == {"requests": 4, "p50_s": 2.5, "p99_s": pytest.approx(float(np.percentile([1, 2, 3, 4], 99))),
                          "max_s": 4.0, "total_s": 10.0}


def test_a_gpu_span_off_cuda_records_nothing_and_lasts_no_gpu_time() -> None:
    with GPUSpan(CPU) as span:
        torch.ones(4).sum()
    assert span.seconds() == 0.0
