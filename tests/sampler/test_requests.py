"""What a request to the sampling engine carries (skyrl_clora.sampler.requests): its RNG seed derived from (run seed,
session, prompt length) alone, 63 bits, the same in every process and run; the frozen sampling settings; and the
queued items' defaults (a request holds no row, slot or version until admitted; no two share their outputs or a
plan's lists)."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import pytest

from skyrl_clora.sampler.requests import PrefillPlan, QueuedRequest, SamplingParams, derive_seed


def test_a_seed_depends_on_run_seed_session_and_prompt_length_only() -> None:
    seed = derive_seed(3, "tenant-seed-7/episode-2", 120)
    assert seed == derive_seed(3, "tenant-seed-7/episode-2", 120)
    others = {derive_seed(4, "tenant-seed-7/episode-2", 120), derive_seed(3, "tenant-seed-7/episode-3", 120),
              derive_seed(3, "tenant-seed-7/episode-2", 121), seed}
    assert len(others) == 4
    seeds = [derive_seed(0, f"s{i}", length) for i in range(200) for length in (1, 50)]
    assert all(0 <= value < 2**63 for value in seeds) and len(set(seeds)) == len(seeds)
    assert max(seeds) >= 2**62, "the seeds span 63 bits"


def test_a_seed_is_the_same_in_every_process() -> None:
    """No per-process salt (as Python's ``hash`` of a string has): a run reproduces its samples when run again, and
    a seed recorded by an earlier run is the one drawn now."""
    assert derive_seed(3, "session", 17) == 1210413059206523047
    assert derive_seed(0, "request-1", 5) == 3024889708922959072


def test_sampling_settings_are_frozen_with_temperature_one_and_the_whole_distribution_by_default() -> None:
    params = SamplingParams(max_tokens=5)
    assert (params.temperature, params.top_p, params.stop_token_ids, params.seed) == (1.0, 1.0, (), 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.seed = 1  # type: ignore[misc]


def test_a_queued_request_holds_nothing_until_admitted_and_owns_its_outputs() -> None:
    first, second = (QueuedRequest([1, 2], "a", SamplingParams(max_tokens=2), concurrent.futures.Future())
                     for _ in range(2))
    assert (first.row, first.lora_slot, first.version, first.history) == (-1, -1, -1, None)
    assert (first.queued_at, first.resumes, first.admitted) == (0, False, 0.0) and first.submitted > 0
    first.output.append(7)
    first.logprobs.append(-1.0)
    assert second.output == [] and second.logprobs == []
    plans = PrefillPlan(), PrefillPlan()
    plans[0].copies[0].append(3)
    plans[0].loads.append("a")
    assert plans[1].copies == ([], []) and plans[1].loads == [] and (plans[1].evictions, plans[1].hits) == (0, 0)
