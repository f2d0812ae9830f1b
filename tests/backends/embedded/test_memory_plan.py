"""Off a GPU the engine's KV cache is bounded by the host memory: every row at full length when that fits in
``HOST_KV_SHARE`` of what is available, else the blocks that share holds, and a one-line refusal when it cannot hold
one sequence. A SkyRL-sized command (1,024 prompts x 5 samples a step) must not exhaust the machine's memory. The
trainer's per-tenant state is held to ``HOST_STORE_SHARE`` of the host memory available when tenants register."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from skyrl_clora.backends.embedded.memory_plan import (
    HOST_KV_SHARE,
    HOST_STORE_SHARE,
    available_host_memory,
    check_tenant_host_memory,
    host_kv_blocks,
    kv_block_bytes,
)
from skyrl_clora.config.schema import ConfigError
from tests.support.transport import swap_trainer

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


def test_host_bytes_is_what_a_registered_tenant_holds(micro_model_dir) -> None:
    store = swap_trainer(micro_model_dir).store
    for name in ("A", "B"):
        state = store.tenants[name]
        held = sum(table.numel() * table.element_size() for table in state.flat.values())
        held += sum(weight.numel() * weight.element_size() for weight in (*state.weights.a.values(), *state.weights.b.values()))
        assert store.host_bytes(state.rank) == held
    assert store.host_bytes(16) == 2 * store.host_bytes(8)


def test_tenants_whose_trainer_state_does_not_fit_the_host_are_refused_in_one_line(micro_model_dir) -> None:
    store = swap_trainer(micro_model_dir).store
    per_tenant = store.host_bytes(16)
    available = int(10.5 * per_tenant / HOST_STORE_SHARE)
    check_tenant_host_memory(store, [16] * 10, available)
    with pytest.raises(ConfigError, match="11 tenants need .* at rank 16.*run at most 10 more tenants") as error:
        check_tenant_host_memory(store, [16] * 11, available)
    assert "\n" not in str(error.value)
    check_tenant_host_memory(store, [8] * 20, available)  # half the rank, half the bytes
