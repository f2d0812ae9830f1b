"""A micro model with two different tenants' adapters and rows that share prompts, for the tests of the trainer's
shared-prompt forwards (``trainer/test_prompt_segments.py`` and ``trainer/test_shared_prefix.py``), which compare
them against every row running its whole sequence (:func:`assert_matches_whole_sequences`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear, attach_multi_lora, write_slot
from skyrl_clora.lora.peft_export import init_adapter


def two_tenant_model(model_dir: Path) -> tuple[torch.nn.Module, LoRARouting, dict[str, MultiLoRALinear]]:
    """The micro model in training mode with two slots of rank 8, each a different adapter (random non-zero B)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    routing, layers = attach_multi_lora(model, num_slots=2, max_rank=8, trainable=True)
    for slot in range(2):
        adapter = init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(slot))
        for path in adapter.b:  # B = 0 would leave the base model's output unchanged: tenants must differ
            adapter.b[path] = torch.randn(adapter.b[path].shape, generator=torch.Generator().manual_seed(slot + 7)) * 0.1
        write_slot(layers, slot, adapter)
    return model, routing, layers


def shared_prompt_rows() -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """Three prompts of different lengths with 3, 1 and 2 samples; prompt 1 and 2 in slot 1, prompt 0 in slot 0."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (length,), generator=generator).tolist() for length in (7, 12, 5)]
    prefix_of = [0, 0, 0, 1, 2, 2]
    responses = [torch.randint(0, 300, (length,), generator=generator).tolist() for length in (4, 9, 1, 6, 3, 8)]
    return [prompts[p] for p in prefix_of], responses, prefix_of, [0 if p == 0 else 1 for p in prefix_of]


def assert_matches_whole_sequences(model_dir: Path, shared_forward: Callable[..., torch.Tensor]) -> None:
    """``shared_forward(decoder, route, input_ids, prompt_lens=, response_lens=, row_slots=, prefix_of=,
    response_width=)`` (the trainer's shared-prompt forwards' signature) over :func:`shared_prompt_rows` on
    :func:`two_tenant_model` gives every row's response hidden states ``[rows, response_width, hidden]`` and LoRA
    gradients as the row running its whole sequence does; rows of another prompt and slot differ."""
    model, routing, layers = two_tenant_model(model_dir)
    prompts, responses, prefix_of, slots = shared_prompt_rows()
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    response_width = max(len(r) for r in responses)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        input_ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response)
    weights = torch.randn(len(prompts), response_width, model.config.hidden_size,
                          generator=torch.Generator().manual_seed(5))
    valid = torch.tensor([[j < len(r) for j in range(response_width)] for r in responses])[..., None]
    params = [layer.lora_a for layer in layers.values()] + [layer.lora_b for layer in layers.values()]

    def loss_and_grads(hidden: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grads = torch.autograd.grad((hidden * weights * valid).sum(), params)
        return hidden.detach() * valid, list(grads)

    got, got_grads = loss_and_grads(shared_forward(
        model.model, lambda token_slots: routing.route(token_slots, None), input_ids,
        prompt_lens=[len(p) for p in prompts], response_lens=[len(r) for r in responses], row_slots=slots,
        prefix_of=prefix_of, response_width=response_width))

    lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)])
    token_slots = torch.where(torch.arange(width)[None] < lengths[:, None], torch.tensor(slots)[:, None], -1)
    with routing.route(token_slots.reshape(-1), None):
        full = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    index = torch.tensor([[min(len(p) - 1 + j, width - 1) for j in range(response_width)] for p in prompts])
    want, want_grads = loss_and_grads(full.gather(1, index[..., None].expand(-1, -1, full.shape[-1])))

    # rows 3 and 4 differ only in their adapter and prompt; same prompt, other slot must change the output
    assert not torch.allclose(got[0, :4], got[3, :4], atol=1e-3), "another prompt and slot change the output"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert b.abs().sum() > 0
        # sums over a prompt's rows reorder float additions: compare at the gradient's own scale
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
