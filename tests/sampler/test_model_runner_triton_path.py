"""The model runner's (skyrl_clora.sampler.model_runner) GPU path (every op through the Triton kernels: multi-LoRA,
decode attention, fused layer ops, with the meta and workspace buffers the CUDA path preallocates), forced on the CPU
through the Triton interpreter, computes what its torch path computes: the shapes, strides and buffers the runner
hands the kernels are the ones they accept."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import skyrl_clora.kernels.dispatch as dispatch
from skyrl_clora.kernels import DecodeWorkspace, LoRAMeta
from skyrl_clora.lora.layers import write_slot
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.model_runner import ModelRunner, PrefillJob

from tests.support.helpers import random_adapter
from tests.support.markers import interpreted

pytestmark = interpreted


def _logits(model: Qwen3ForCausalLM, triton_path: bool,
            kv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, ModelRunner]:
    runner = ModelRunner(model, num_rows=16, max_len=64, block_size=16, prefill_tokens=32, share_prefix_reads=True,
                         kv_dtype=kv_dtype)
    if triton_path:  # the buffers ModelRunner preallocates on CUDA
        runner.lora_meta = LoRAMeta(32, 2, "cpu", max_rank=16, max_slices=3)
        runner._attention_workspace = DecodeWorkspace(16, 4, 64, 32, "cpu")
    tokens = torch.arange(3, 23)
    # The same prompt in row 1 with the adapter, in row 3 without it and in row 5 with it again, then one
    # decode step of each; row 5 reads its first 16 positions from row 1 (the same K/V there).
    prefill = runner.prefill([PrefillJob(row=1, tokens=tokens, lora_slot=0), PrefillJob(row=3, tokens=tokens, lora_slot=-1),
                              PrefillJob(row=5, tokens=tokens, lora_slot=0)])
    runner.set_decode_inputs([0, 5, 0, 5, 0, 5] + [0] * 10, [0, 20, 0, 20, 0, 20] + [0] * 10, [-1, 0, -1, -1, -1, 0] + [-1] * 10,
                             prefix_rows=[0, 1, 2, 3, 4, 1] + list(range(6, 16)), prefix_lens=[0] * 5 + [16] + [0] * 10)
    decoded = runner.decode(16)
    # The same prompt, adapter and token: the same logits (the kernels read row 5's prefix in a program of
    # its own, whose partial softmax is merged with the rest: equal up to rounding).
    same = torch.allclose(decoded[5], decoded[1], atol=1e-5) if triton_path else torch.equal(decoded[5], decoded[1])
    assert same, float((decoded[5] - decoded[1]).abs().max())
    return torch.stack(prefill[:2]), decoded[[1, 3]], runner


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model-cache", "fp8-cache"])
@pytest.mark.parametrize("fold", [True, False], ids=["folded-gemm", "base-gemm-and-shrink"])
def test_triton_path_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch, fold: bool,
                                            kv_dtype: torch.dtype | None) -> None:
    """Also with an fp8 cache: both paths write the same e4m3 K/V (layer 0's are the model-dtype cache's cast to
    fp8: its K/V do not depend on attention) and read them back alike."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # the fused q/k/v kernel's least
    model = Qwen3ForCausalLM(config).eval()
    _, layers = attach_engine_lora(model, num_slots=2, max_rank=16)
    write_slot(layers, 0, random_adapter(layers, 1, rank=8))
    want_prefill, want_decode, torch_runner = _logits(model, triton_path=False, kv_dtype=kv_dtype)
    model_dtype_runner = _logits(model, triton_path=False)[2]
    assert not torch.allclose(want_prefill[0], want_prefill[1], atol=1e-3), "the adapter must change the row's logits"
    assert not torch.allclose(want_decode[0], want_decode[1], atol=1e-3), "the adapter must change the row's logits"
    monkeypatch.setattr(dispatch, "use_triton", lambda x, backend: True)
    monkeypatch.setattr(dispatch, "fold_pays", lambda *shape: fold)  # both Triton paths of folded_lora_linear
    got_prefill, got_decode, triton_runner = _logits(model, triton_path=True, kv_dtype=kv_dtype)
    if kv_dtype is not None:
        assert torch_runner.k_cache.dtype == triton_runner.k_cache.dtype == kv_dtype
        for runner in (torch_runner, triton_runner):  # equal values: the interpreter's fp8 cast drops a zero's sign
            for cache, wide in ((runner.k_cache, model_dtype_runner.k_cache), (runner.v_cache, model_dtype_runner.v_cache)):
                assert torch.equal(cache[0].float(), wide[0].to(kv_dtype).float())
                assert not torch.equal(cache[1].float(), wide[1].float()), "layer 1 read the fp8 layer 0"
    assert torch.allclose(got_prefill, want_prefill, atol=1e-5), float((got_prefill - want_prefill).abs().max())
    assert torch.allclose(got_decode, want_decode, atol=1e-5), float((got_decode - want_decode).abs().max())
