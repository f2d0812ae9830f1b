"""The two-pass shared-prompt forward (:mod:`skyrl_clora.trainer.shared_prefix`): each distinct prompt runs once in
a prompt pass and every row's response attends over its prompt's recorded K/V, giving the hidden states and LoRA
gradients of every row running its whole sequence, with two tenants' adapters in one pass; which rows represent the
prompts, and which decoders the response pass's mask reproduces."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from skyrl_clora.trainer.shared_prefix import prompt_representatives, shared_prefix_hidden, supports_shared_prefix
from tests.support.shared_prompt_rows import shared_prompt_rows, two_tenant_model


def test_each_prompt_is_represented_by_its_first_row() -> None:
    assert prompt_representatives([0, 0, 1, 0, 2, 1]) == [0, 2, 4]
    assert prompt_representatives([1, 0, 1, 0]) == [1, 0]
    assert prompt_representatives([]) == []


def test_only_decoders_of_full_attention_layers_share_prompts() -> None:
    def decoder(layer_types: list[str] | None) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(layer_types=layer_types))

    assert supports_shared_prefix(decoder(None)) and supports_shared_prefix(decoder(["full_attention"] * 3))
    assert supports_shared_prefix(SimpleNamespace(config=SimpleNamespace()))
    assert not supports_shared_prefix(decoder(["full_attention", "sliding_attention"]))


def test_two_passes_match_whole_sequences_in_values_and_gradients(micro_model_dir: Path) -> None:
    model, routing, layers = two_tenant_model(micro_model_dir)
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

    calls: list[tuple[int, ...]] = []
    forward = model.model.forward
    model.model.forward = lambda *args, **kwargs: calls.append(tuple(kwargs["input_ids"].shape)) or forward(*args, **kwargs)
    got, got_grads = loss_and_grads(shared_prefix_hidden(
        model.model, lambda token_slots: routing.route(token_slots, None), input_ids,
        prompt_lens=[len(p) for p in prompts], response_lens=[len(r) for r in responses], row_slots=slots,
        prefix_of=prefix_of, response_width=response_width))
    assert calls == [(3, 12), (6, response_width)], "three distinct prompts once, then every row's response"
    model.model.forward = forward

    lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)])
    token_slots = torch.where(torch.arange(width)[None] < lengths[:, None], torch.tensor(slots)[:, None], -1)
    with routing.route(token_slots.reshape(-1), None):
        full = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    index = torch.tensor([[min(len(p) - 1 + j, width - 1) for j in range(response_width)] for p in prompts])
    want, want_grads = loss_and_grads(full.gather(1, index[..., None].expand(-1, -1, full.shape[-1])))

    assert not torch.allclose(got[0, :4], got[3, :4], atol=1e-3), "another prompt and slot change the output"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
