"""The two-pass shared-prompt forward (:mod:`skyrl_clora.trainer.shared_prefix`): each distinct prompt runs once in
a prompt pass and every row's response attends over its prompt's recorded K/V, giving the hidden states and LoRA
gradients of every row running its whole sequence, with two tenants' adapters in one pass; which rows represent the
prompts, and which decoders the response pass's mask reproduces."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from skyrl_clora.trainer.shared_prefix import prompt_representatives, shared_prefix_hidden, supports_shared_prefix
from tests.support.shared_prompt_rows import assert_matches_whole_sequences, shared_prompt_rows


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
    calls: list[tuple[int, ...]] = []

    def counted(decoder: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
        """shared_prefix_hidden, each of the decoder's forwards recorded by its input's shape."""
        forward = decoder.forward
        decoder.forward = lambda *a, **k: calls.append(tuple(k["input_ids"].shape)) or forward(*a, **k)
        try:
            return shared_prefix_hidden(decoder, *args, **kwargs)
        finally:
            decoder.forward = forward

    assert_matches_whole_sequences(micro_model_dir, counted)
    response_width = max(len(response) for response in shared_prompt_rows()[1])
    assert calls == [(3, 12), (6, response_width)], "three distinct prompts once, then every row's response"

