"""The model runner (skyrl_clora.sampler.model_runner): its prefill and decode logits are the HF forward's; a prompt
split over ragged passes, or started past positions whose K/V its row already holds, gives the logits of one whole
pass; the paged cache's block tables, K/V reads, writes and block copies; a decode position fed from its row's token
drawn on the device; the CUDA-graph buckets; and the models and sizes it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.model_runner import ModelRunner, PrefillJob, decode_buckets, prefill_buckets

from tests.support.engine_driver import PROMPT


def test_prefill_and_decode_logits_match_the_hf_forward(micro_model_dir: Path) -> None:
    """The runner's own layer loop (fused-op references, slot KV cache) computes what the HF model computes."""
    from skyrl_clora.sampler.model_runner import ModelRunner, PrefillJob

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    routing, _ = attach_engine_lora(model, num_slots=2, max_rank=8)
    runner = ModelRunner(model, num_rows=16, max_len=64, block_size=16, prefill_tokens=64)
    tokens = torch.tensor(PROMPT + [3, 4, 5])
    prefill_logits = runner.prefill([PrefillJob(row=2, tokens=tokens[:-1], lora_slot=-1)])[0]
    runner.set_decode_inputs([0, 0, int(tokens[-1])] + [0] * 13, [0, 0, len(tokens) - 1] + [0] * 13, [-1] * 16)
    decode_logits = runner.decode(16)[2]
    with torch.no_grad():
        want = model(input_ids=tokens[None]).logits[0].float()
    assert torch.allclose(prefill_logits, want[-2], atol=1e-4), float((prefill_logits - want[-2]).abs().max())
    assert torch.allclose(decode_logits, want[-1], atol=1e-4), float((decode_logits - want[-1]).abs().max())


def _tiny_model(hidden_act: str = "silu") -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 (random weights) with engine LoRA layers of one slot."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act=hidden_act)
    model = Qwen3ForCausalLM(config).eval()
    attach_engine_lora(model, num_slots=1, max_rank=4)
    return model


def test_graphs_are_captured_for_every_span_and_flat_batch_a_step_can_round_up_to() -> None:
    assert decode_buckets(16) == [16] and decode_buckets(40) == [16, 32, 40]
    assert decode_buckets(300) == [16, 32, 48, 64, 128, 192, 256, 300]
    assert prefill_buckets(16) == [16] and prefill_buckets(128) == [16, 32, 64, 128]
    assert prefill_buckets(1500) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1500]


@pytest.mark.parametrize(("options", "reason"), [
    (dict(max_len=40), "max_len 40 must be a multiple of the prefill block size 16"),
    (dict(num_rows=20), "num_rows 20 must be a multiple of 16"),
    (dict(prefill_tokens=24), "prefill_tokens 24 must be a positive multiple of the block size 16"),
    (dict(prefill_tokens=8), "prefill_tokens 8 must be a positive multiple of the block size 16"),
    (dict(kv_dtype=torch.float16), "kv_dtype torch.float16 is neither the model's torch.float32 nor"),
])
def test_sizes_and_cache_dtypes_the_runner_cannot_run_are_refused(options: dict, reason: str) -> None:
    sizes = dict(num_rows=16, max_len=64, block_size=16, prefill_tokens=32) | options
    with pytest.raises(ValueError, match=reason):
        ModelRunner(_tiny_model(), **sizes)


def test_a_model_whose_mlp_is_not_swiglu_is_refused() -> None:
    with pytest.raises(ValueError, match="SwiGLU MLPs .* this model has gelu"):
        ModelRunner(_tiny_model(hidden_act="gelu"), num_rows=16, max_len=64, block_size=16, prefill_tokens=32)


def test_block_tables_give_each_row_a_run_of_its_own_without_a_pool_and_the_scratch_block_with_one() -> None:
    runner = ModelRunner(_tiny_model(), num_rows=16, max_len=64, block_size=16, prefill_tokens=32)
    assert runner.num_blocks == 64 and runner.k_cache.shape == (2, 65, 1, 16, 16) == runner.v_cache.shape
    assert runner.block_tables[:16].tolist() == [[4 * row + i for i in range(4)] for row in range(16)]
    assert runner.block_tables[16].tolist() == [64] * 4 and runner.scratch_row == 16
    pooled = ModelRunner(_tiny_model(), num_rows=16, max_len=64, block_size=16, prefill_tokens=32, num_blocks=10)
    assert pooled.k_cache.shape[1] == 11 and bool((pooled.block_tables == 10).all())
    tables = np.full((17, 4), 10, dtype=np.int32)
    tables[3] = [7, 2, 9, 10]
    pooled.set_block_tables(tables)
    assert pooled.block_tables.tolist() == tables.tolist()


def test_a_prompt_split_over_passes_or_started_past_its_rows_kv_gives_the_logits_of_one_pass() -> None:
    """A budget of 32 positions a pass: job a (40 tokens) takes two passes, job b (5 tokens) shares a's last; their
    logits and K/V are those of a runner that takes each in one pass. Row 3, holding a's first 32 positions' K/V
    (written from row 1's), prefilled from position 32 on gives a's logits too; a start past the prompt is refused."""
    model = _tiny_model()
    a, b = torch.arange(3, 43) % 64, torch.tensor([9, 8, 7, 6, 5])
    narrow = ModelRunner(model, num_rows=16, max_len=64, block_size=16, prefill_tokens=32)
    passes: list[int] = []
    run_pass = narrow._prefill_pass
    narrow._prefill_pass = lambda chunks: passes.append(len(chunks)) or run_pass(chunks)
    split = narrow.prefill([PrefillJob(row=1, tokens=a, lora_slot=-1), PrefillJob(row=2, tokens=b, lora_slot=-1)])
    assert passes == [1, 2]
    wide = ModelRunner(model, num_rows=16, max_len=64, block_size=16, prefill_tokens=64)
    whole = [wide.prefill([PrefillJob(row=row, tokens=tokens, lora_slot=-1)])[0] for row, tokens in ((1, a), (2, b))]
    assert not torch.allclose(whole[0], whole[1], atol=1e-3), "the two prompts' logits must differ"
    for got, want in zip(split, whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for row, length in ((1, 40), (2, 5)):
        for got, want in zip(narrow.read_kv(row, 0, length), wide.read_kv(row, 0, length)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wide.write_kv(3, 0, wide.read_kv(1, 0, 32))
    resumed = wide.prefill([PrefillJob(row=3, tokens=a, lora_slot=-1, start=32)])[0]
    torch.testing.assert_close(resumed, whole[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefill start 40 must be below the prompt length 40"):
        wide.prefill([PrefillJob(row=4, tokens=a, lora_slot=-1, start=40)])


def test_read_write_and_copy_move_every_layers_kv_through_the_block_tables() -> None:
    runner = ModelRunner(_tiny_model(), num_rows=16, max_len=64, block_size=16, prefill_tokens=32)
    runner.prefill([PrefillJob(row=0, tokens=torch.arange(5, 25), lora_slot=-1)])
    k, v = runner.read_kv(0, 3, 20)
    assert k.shape == v.shape == (2, 1, 17, 16) and k.abs().sum() > 0 and not torch.equal(k, v)
    assert torch.equal(k[:, :, :13], runner.k_cache[:, 0, :, 3:16])
    assert torch.equal(v[:, :, 13:], runner.v_cache[:, 1, :, :4])
    runner.write_kv(5, 10, (k, v))  # row 5 owns blocks 20-23: positions 10-26
    assert torch.equal(runner.read_kv(5, 10, 27)[0], k) and torch.equal(runner.read_kv(5, 10, 27)[1], v)
    assert not runner.k_cache[:, 20, :, :10].any(), "positions before 10 untouched"
    before = runner.k_cache.clone()
    runner.copy_blocks([0, 1], [40, 63])
    assert torch.equal(runner.k_cache[:, 40], before[:, 0]) and torch.equal(runner.k_cache[:, 63], before[:, 1])
    assert torch.equal(runner.v_cache[:, 40], runner.v_cache[:, 0])
    assert torch.equal(runner.k_cache[:, 41], before[:, 41]), "the other blocks untouched"


def test_a_decode_position_from_sampled_takes_its_rows_token_drawn_on_the_device() -> None:
    runner = ModelRunner(_tiny_model(), num_rows=16, max_len=64, block_size=16, prefill_tokens=32,
                         share_prefix_reads=True)
    runner.record_sampled(torch.tensor([3, 2]), torch.tensor([42, 17]))
    runner.set_decode_inputs(np.array([5, 6, 7]), np.array([1, 2, 3]), np.array([0, -1, 0]), prefix_rows=[0, 0, 2],
                             prefix_lens=[16, 16, 0], from_sampled=np.array([0, 1, 1]), rows=np.array([2, 3, 16]))
    assert runner.decode_tokens[:3].tolist() == [5, 42, 0], "the scratch row drew nothing"
    assert runner.decode_rows[:3].tolist() == [2, 3, 16] and runner.decode_positions[:3].tolist() == [1, 2, 3]
    assert runner.decode_slots[:3].tolist() == [0, -1, 0]
    assert runner.decode_prefix_rows[:3].tolist() == [0, 0, 2] and runner.decode_prefix_lens[:3].tolist() == [16, 16, 0]
    runner.set_decode_inputs([8], [4], [-1])
    assert runner.decode_tokens[:3].tolist() == [8, 42, 0] and runner.decode_rows[0] == 0
