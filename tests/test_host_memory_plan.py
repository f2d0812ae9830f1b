"""Off a GPU the engine's KV cache is bounded by the host memory: every row at full length when that fits in
``HOST_KV_SHARE`` of what is available, else the blocks that share holds, and a one-line refusal when it cannot hold
one sequence. A SkyRL-sized command (1,024 prompts x 5 samples a step) must not exhaust the machine's memory."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from skyrl_clora.backends.embedded.memory_plan import HOST_KV_SHARE, available_host_memory, host_kv_blocks, kv_block_bytes
from skyrl_clora.config import ConfigError

CONFIG = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
BLOCK = kv_block_bytes(CONFIG, 32, torch.float32)  # 2 * 4 layers * 2 heads * 32 positions * 16 dims * 4 bytes


def test_every_row_at_full_length_when_it_fits() -> None:
    rows, max_len = 64, 320  # 10 blocks a row
    assert host_kv_blocks(CONFIG, dtype=torch.float32, block_size=32, rows=rows, max_len=max_len,
                          available=int(rows * 10 * BLOCK / HOST_KV_SHARE)) is None


def test_the_share_of_available_memory_bounds_the_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    available = int(200 * BLOCK / HOST_KV_SHARE)
    blocks = host_kv_blocks(CONFIG, dtype=torch.float32, block_size=32, rows=5120, max_len=1536, available=available)
    assert blocks == 200
    assert "host memory plan" in capsys.readouterr().err
    half = host_kv_blocks(CONFIG, dtype=torch.bfloat16, block_size=32, rows=5120, max_len=1536, available=available)
    assert half == 400, "a bf16 cache's blocks take half the bytes"


def test_too_little_memory_for_one_sequence_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="fewer than the 48 one sequence of 1536 tokens needs") as error:
        host_kv_blocks(CONFIG, dtype=torch.float32, block_size=32, rows=8, max_len=1536,
                       available=int(10 * BLOCK / HOST_KV_SHARE))
    assert "\n" not in str(error.value)


def test_available_host_memory_is_positive() -> None:
    assert available_host_memory() > 0
