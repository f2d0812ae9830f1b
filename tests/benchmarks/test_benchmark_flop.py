"""``benchmarks.common.train_pass_flop``, the numerator of the benchmarks' training MFU: its coefficients against the
matrix products that torch's FLOP counter sees in a LoRA forward and backward, and its counting of shared prompts."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import build_random_model, qwen3_config, train_pass_flop
from skyrl_clora.lora.layers import attach_multi_lora

RANK = 4


def addmm_flop(bias_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOP of ``bias.addmm_(a, b)``: the product's (torch's counter has this formula for ``addmm``, not ``addmm_``)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def test_one_position_costs_what_a_lora_forward_and_backward_multiplies():
    # At one position causal attention is the full attention the eager kernels compute, so every term compares.
    config = qwen3_config("tiny", vocab_size=96, attn_implementation="eager")
    model = build_random_model(config, "cpu").requires_grad_(False)  # frozen base: no weight gradients
    routing, layers = attach_multi_lora(model, num_slots=1, max_rank=RANK, trainable=True)
    for layer in layers.values():
        torch.nn.init.normal_(layer.lora_a, std=0.1)
        torch.nn.init.normal_(layer.lora_b, std=0.1)
    # The embedding's output requires a gradient so that the first layer's input gradient is computed, as counted.
    embeds = model.get_input_embeddings()(torch.tensor([[5]])).requires_grad_()
    # The LoRA layers' base GEMMs accumulate in place (addmm_), which the counter does not count by itself.
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_flop}) as counter:
        with routing.route(torch.zeros(1, dtype=torch.long), single_slot=0):
            model(inputs_embeds=embeds).logits.float().sum().backward()
    assert all(layer.lora_a.grad is not None for layer in layers.values())
    counts = counter.get_flop_counts()
    rotary = sum(counts[next(name for name in counts if name.endswith("rotary_emb"))].values())  # the angles' product
    assert train_pass_flop(config, RANK, [0], [1], ["g"], shared_prompts=False) == counter.get_total_flops() - rotary


def test_a_shared_prompt_is_computed_once_per_group():
    config = qwen3_config("tiny")
    prompts, responses, groups = [3, 3, 5], [2, 4, 1], ["a", "a", "b"]
    shared = train_pass_flop(config, RANK, prompts, responses, groups, shared_prompts=True)
    per_row = train_pass_flop(config, RANK, prompts, responses, groups, shared_prompts=False)
    prompt_alone = train_pass_flop(config, RANK, [3], [0], ["a"], shared_prompts=True)
    assert per_row - shared == prompt_alone > 0
    # a response over a prompt attends to it: more than the two apart
    response_alone = train_pass_flop(config, RANK, [0], [2], ["a"], shared_prompts=True)
    assert train_pass_flop(config, RANK, [3], [2], ["a"], shared_prompts=True) > prompt_alone + response_alone
