"""The engine's folded projections (q/k/v, o, gate/up, down): base weights and LoRA A buffers become views of
one matrix per group (base weights shared with the trainer's twin), publishes land in it, and the runner's
logits with adapters equal the HF forward through the unfused multi-LoRA layers (Qwen3, and Qwen2 with q/k/v
biases)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.backends.embedded.services import _twin_sharing_weights
from skyrl_clora.lora.layers import attach_multi_lora, write_slot
from skyrl_clora.sampler.fused_projections import attach_engine_lora, fuse_base_projections, fused_layer_projections
from skyrl_clora.sampler.model_runner import ModelRunner, PrefillJob

from tests.support.helpers import random_adapter

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE)).eval()


def test_fused_weights_are_views_shared_with_the_twin() -> None:
    model = _model("qwen2")
    attn = model.model.layers[1].self_attn
    before = {name: getattr(attn, name).weight.clone() for name in ("q_proj", "k_proj", "v_proj")}
    assert attn.q_proj.bias is not None, "Qwen2's q/k/v have biases"
    fuse_base_projections(model.model.layers, num_slots=3, max_rank=8)
    folded = attn.folded_qkv
    width = sum(t.shape[0] for t in before.values())
    assert folded.weight.shape == (width + 3 * 3 * 8, SHAPE["hidden_size"]) and folded.bias is not None
    assert folded.lora_a.shape == (3, 3, 8, SHAPE["hidden_size"]) and not folded.lora_a.any(), "zeroed A rows"
    assert attn.folded_o.lora_a.shape == (3, 8, SHAPE["hidden_size"]), "one projection: one A per slot"
    assert not folded.bias[width:].any(), "the A rows' outputs get no bias"
    for name, value in before.items():
        linear = getattr(attn, name)
        assert torch.equal(linear.weight, value)
        assert linear.weight.untyped_storage().data_ptr() == folded.weight.untyped_storage().data_ptr()
    assert attn.o_proj.weight.untyped_storage().data_ptr() == attn.folded_o.weight.untyped_storage().data_ptr()
    fuse_base_projections(model.model.layers, num_slots=3, max_rank=8)
    assert attn.folded_qkv is folded, "folding again changes nothing"
    with pytest.raises(ValueError, match="folded for 3 slots of rank 8"):
        fuse_base_projections(model.model.layers, num_slots=4, max_rank=8)
    twin = _twin_sharing_weights(model)
    assert twin.model.layers[1].self_attn.k_proj.weight.data_ptr() == attn.k_proj.weight.data_ptr()
    assert twin.model.layers[1].mlp.up_proj.weight.data_ptr() == model.model.layers[1].mlp.up_proj.weight.data_ptr()
    assert twin.model.layers[1].mlp.down_proj.weight.data_ptr() == model.model.layers[1].mlp.down_proj.weight.data_ptr()


def test_engine_lora_buffers_are_views_of_the_folded_weights_that_publishes_reach() -> None:
    model = _model("qwen3")
    routing, layers = attach_engine_lora(model, num_slots=3, max_rank=8)
    write_slot(layers, 2, random_adapter(layers, seed=3))
    projections = fused_layer_projections(model.model.layers)[0]
    write_slot(layers, 1, random_adapter(layers, seed=4))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert torch.equal(projections.qkv.folded.lora_a[2], attn.v_proj.lora_a) and attn.v_proj.lora_a[1].abs().sum() > 0
    assert attn.v_proj.lora_a.data_ptr() == projections.qkv.folded.lora_a[2].data_ptr()
    assert torch.equal(projections.down.folded.lora_a, mlp.down_proj.lora_a) and mlp.down_proj.lora_a[2].abs().sum() > 0
    assert mlp.down_proj.lora_a.data_ptr() == projections.down.folded.lora_a.data_ptr()
    assert attn.k_proj.scales is attn.q_proj.scales and float(projections.qkv.scales[1]) == 2.0
    assert projections.gate_up.lora_b[1] is mlp.up_proj.lora_b


@pytest.mark.parametrize("trainable", [False, True])
def test_the_engine_refuses_lora_layers_that_attach_engine_lora_did_not_make(trainable: bool) -> None:
    model = _model("qwen3")
    attach_multi_lora(model, num_slots=2, max_rank=8, trainable=trainable)
    with pytest.raises(ValueError, match="attach_engine_lora"):
        fused_layer_projections(model.model.layers)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_runner_logits_with_adapters_equal_the_unfused_hf_forward(kind: str) -> None:
    model = _model(kind)
    routing, layers = attach_engine_lora(model, num_slots=2, max_rank=8)
    runner = ModelRunner(model, num_rows=16, max_len=64, block_size=16, prefill_tokens=64)
    write_slot(layers, 1, random_adapter(layers, seed=1))
    tokens = torch.tensor([5, 9, 31, 7, 200, 11, 3, 42, 17, 8])
    with_adapter = runner.prefill([PrefillJob(row=0, tokens=tokens, lora_slot=1)])[0]
    base = runner.prefill([PrefillJob(row=1, tokens=tokens, lora_slot=-1)])[0]
    assert not torch.allclose(with_adapter, base, atol=1e-3), "the adapter must change the logits"
    with torch.no_grad(), routing.route(torch.ones(len(tokens), dtype=torch.long)):
        want = model(input_ids=tokens[None]).logits[0, -1].float()
    torch.testing.assert_close(with_adapter, want, rtol=1e-4, atol=1e-4)
