"""Engine threads on a model saved in HF format (the micro model), for the tests that drive the sampling engine
through its thread-safe API (``EngineThread``): one started with random adapters registered, and the seeded
sampling settings those tests submit with."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM

from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.helpers import start_engine


def engine_on(model_dir: Path, num_rows: int, adapters: dict[str, int], max_len: int = 96,
              reuse_decode_kv: bool = False, share_prefix_reads: bool = False, **options: object
              ) -> tuple[EngineThread, dict]:
    """An engine thread on the model in ``model_dir`` (``helpers.start_engine``: a random adapter per ``adapters``
    entry, name -> seed) with ``num_rows`` rows of ``max_len`` positions and the other :class:`EngineConfig` fields
    ``options``; returns the thread and the adapters' weights by name."""
    config = EngineConfig(num_rows=num_rows, max_len=max_len, reuse_decode_kv=reuse_decode_kv,
                          share_prefix_reads=share_prefix_reads, **options)
    return start_engine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), config, adapters)


def seeded_params(seed: int, max_tokens: int = 12) -> SamplingParams:
    """Sampling at temperature 1 with ``seed``, ``max_tokens`` tokens at most."""
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
