"""The engine's settings (skyrl_clora.sampler.engine_config): a frozen value whose defaults are the CPU engine's
(FIFO admission, KV reservations, prefix caching on, decode-K/V reuse and shared prefix reads off, the high stream
priority), refusing at construction an unknown stream priority or admission order and a size below 1."""

from __future__ import annotations

import dataclasses

import pytest

from skyrl_clora.sampler.engine_config import STREAM_PRIORITIES, EngineConfig


def test_the_defaults_are_the_cpu_engines_and_the_value_is_frozen() -> None:
    config = EngineConfig(num_rows=4, max_len=64)
    assert (config.max_prefills_per_step, config.block_size, config.num_blocks) == (8, 16, None)
    assert config.cache_prefixes and config.cuda_graphs and config.reserve_kv
    assert not config.reuse_decode_kv and not config.share_prefix_reads
    assert (config.stream_priority, config.admission) == ("high", "fifo")
    assert config.prefill_wait_steps == 0 and config.kv_dtype is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_rows = 8  # type: ignore[misc]
    assert dataclasses.replace(config, admission="fair").admission == "fair"


def test_the_stream_priorities_rank_the_engine_ahead_of_the_trainers_default_stream() -> None:
    assert STREAM_PRIORITIES["high"] < STREAM_PRIORITIES["normal"] == 0  # CUDA: lower is higher


@pytest.mark.parametrize(("options", "reason"), [
    (dict(stream_priority="low"), r"stream_priority='low' is unknown; use one of \['high', 'normal'\]"),
    (dict(admission="lottery"), "admission='lottery' is unknown; use one of fifo, fair"),
    (dict(num_rows=0), "EngineConfig.num_rows must be at least 1, got 0"),
    (dict(max_len=-3), "EngineConfig.max_len must be at least 1, got -3"),
    (dict(max_prefills_per_step=0), "EngineConfig.max_prefills_per_step must be at least 1, got 0"),
    (dict(block_size=0), "EngineConfig.block_size must be at least 1, got 0"),
])
def test_unknown_names_and_sizes_below_one_are_refused(options: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        EngineConfig(**{"num_rows": 4, "max_len": 64, **options})


def test_the_smallest_sizes_and_every_known_name_are_taken() -> None:
    for priority in STREAM_PRIORITIES:
        for admission in ("fifo", "fair"):
            config = EngineConfig(num_rows=1, max_len=1, max_prefills_per_step=1, block_size=1,
                                  stream_priority=priority, admission=admission)
            assert (config.stream_priority, config.admission) == (priority, admission)
