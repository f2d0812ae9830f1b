"""The engine's fused q/k/v and gate/up projections: weights become views of one matrix (shared with the
trainer's twin), LoRA A buffers views of one stack, and the runner's logits with adapters equal the HF
forward through the unfused multi-LoRA layers (Qwen3, and Qwen2 with q/k/v biases)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora, write_slot
from skyrl_clora.sampler.fused_projections import fuse_base_projections, fused_layer_projections
from skyrl_clora.sampler.model_runner import ModelRunner, PrefillJob
from skyrl_clora.services import _twin_sharing_weights

from helpers import random_adapter

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
    fuse_base_projections(model.model.layers)
    weight, bias = attn.fused_qkv
    assert weight.shape == (sum(t.shape[0] for t in before.values()), SHAPE["hidden_size"]) and bias is not None
    for name, value in before.items():
        linear = getattr(attn, name)
        assert torch.equal(linear.weight, value)
        assert linear.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    fuse_base_projections(model.model.layers)
    assert attn.fused_qkv[0] is weight, "fusing again changes nothing"
    twin = _twin_sharing_weights(model)
    assert twin.model.layers[1].self_attn.k_proj.weight.data_ptr() == attn.k_proj.weight.data_ptr()
    assert twin.model.layers[1].mlp.up_proj.weight.data_ptr() == model.model.layers[1].mlp.up_proj.weight.data_ptr()


def test_lora_buffers_are_views_of_one_stack_that_publishes_reach() -> None:
    model = _model("qwen3")
    routing, layers = attach_multi_lora(model, num_slots=3, max_rank=8, trainable=False)
    qkv, gate_up = fused_layer_projections(model.model.layers)[0]
    write_slot(layers, 1, random_adapter(layers, seed=4))
    attn = model.model.layers[0].self_attn
    assert torch.equal(qkv.lora_a[2], attn.v_proj.lora_a) and qkv.lora_a[2].abs().sum() > 0
    assert attn.k_proj.scales is attn.q_proj.scales and float(qkv.scales[1]) == 2.0
    assert gate_up.lora_b[1] is model.model.layers[0].mlp.up_proj.lora_b
    with pytest.raises(ValueError, match="inference MultiLoRALinear"):
        trainable = _model("qwen3")
        attach_multi_lora(trainable, num_slots=2, max_rank=8, trainable=True)
        fused_layer_projections(trainable.model.layers)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_runner_logits_with_adapters_equal_the_unfused_hf_forward(kind: str) -> None:
    model = _model(kind)
    routing, layers = attach_multi_lora(model, num_slots=2, max_rank=8, trainable=False)
    runner = ModelRunner(model, routing, num_rows=16, max_len=64, block_size=16, prefill_tokens=64)
    write_slot(layers, 1, random_adapter(layers, seed=1))
    tokens = torch.tensor([5, 9, 31, 7, 200, 11, 3, 42, 17, 8])
    with_adapter = runner.prefill([PrefillJob(row=0, tokens=tokens, lora_slot=1)])[0]
    base = runner.prefill([PrefillJob(row=1, tokens=tokens, lora_slot=-1)])[0]
    assert not torch.allclose(with_adapter, base, atol=1e-3), "the adapter must change the logits"
    with torch.no_grad(), routing.route(torch.ones(len(tokens), dtype=torch.long)):
        want = model(input_ids=tokens[None]).logits[0, -1].float()
    torch.testing.assert_close(with_adapter, want, rtol=1e-4, atol=1e-4)
