"""The trainer's forward for micro-batches whose rows share prompts: each distinct prompt runs once.

GRPO draws several samples per prompt, so a tenant's batch holds every prompt ``samples`` times. A
row's prompt positions see only the prompt, so their hidden states and K/V are the same in every row of
the prompt (and of the tenant: another tenant's adapter changes them). Two passes through the decoder
compute exactly what one pass over the full rows computes:

1. the prompt pass runs the ``U`` distinct prompts ``[U, P]`` (right-padded, causal) and records every
   layer's K/V;
2. the response pass runs the rows' responses ``[B, R]`` at positions ``P_b + j``, each layer attending
   over its row's prompt K/V (gathered from the prompt pass, so their gradients sum over the rows of a
   prompt) followed by the response's own K/V, under a mask that hides the prompt padding and keeps the
   responses causal.

The hidden state that predicts response token ``j`` of row ``b`` is the prompt pass's at ``P_b - 1`` for
``j = 0`` and the response pass's at ``j - 1`` after. The Hugging Face decoder runs unchanged: it takes a
precomputed attention mask (a dict per attention type) and calls ``past_key_values.update`` once per
layer, which the two small cache stand-ins below answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from skyrl_clora.device.staging import lists_to_device


class _RecordKV:
    """Stands in for a Hugging Face cache in the prompt pass: keeps each layer's K/V ``[U, KV, P, d]``."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        return key_states, value_states


class _PrefixKV:
    """Stands in for a Hugging Face cache in the response pass: puts row ``b``'s prompt K/V (prompt
    ``prefix_of[b]`` of the recorded ones) in front of the response's own, ``[B, KV, P + R, d]``."""

    def __init__(self, recorded: _RecordKV, prefix_of: torch.Tensor) -> None:
        self.recorded = recorded
        self.prefix_of = prefix_of

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys = self.recorded.keys[layer_idx].index_select(0, self.prefix_of)
        values = self.recorded.values[layer_idx].index_select(0, self.prefix_of)
        return torch.cat([keys, key_states], dim=2), torch.cat([values, value_states], dim=2)


def prompt_representatives(prefix_of: list[int]) -> list[int]:
    """For prompts ``0..U-1`` (``prefix_of[b]``: row ``b``'s prompt), the first row of each."""
    first_row: dict[int, int] = {}
    for row, prefix in enumerate(prefix_of):
        first_row.setdefault(prefix, row)
    return [first_row[prefix] for prefix in range(len(first_row))]


def supports_shared_prefix(decoder: nn.Module) -> bool:
    """Whether every attention layer of ``decoder`` is full (causal) attention, which the response pass's
    mask reproduces (sliding-window layers would need their window in it)."""
    return set(getattr(decoder.config, "layer_types", None) or ["full_attention"]) == {"full_attention"}


def shared_prefix_hidden(
    decoder: nn.Module,
    route: Callable[[torch.Tensor], contextlib.AbstractContextManager],
    input_ids: torch.Tensor,
    prompt_lens: list[int],
    response_lens: list[int],
    row_slots: list[int],
    prefix_of: list[int],
    response_width: int,
) -> torch.Tensor:
    """Final hidden states ``[B, response_width, H]`` predicting each row's response tokens.

    ``input_ids: [B, W]`` holds each row's prompt then response (right-padded); row ``b`` has a prompt of
    ``prompt_lens[b]`` and a response of ``response_lens[b]`` tokens, uses LoRA slot ``row_slots[b]`` and
    shares its prompt with every row of the same ``prefix_of[b]`` (``0..U-1``; rows of one prompt must
    have the same prompt tokens and slot). ``route(token_slots)`` routes a pass's flattened tokens to
    their slots. Entries past a row's response hold values the caller masks out."""
    device = input_ids.device
    reps = prompt_representatives(prefix_of)
    num_prefixes = len(reps)
    lens = [prompt_lens[row] for row in reps]
    width = max(lens)
    reps_t, lens_t, rep_slots, row_prompt_lens, row_prefix, row_response_lens, row_slots_t = lists_to_device(
        [reps, lens, [row_slots[row] for row in reps], prompt_lens, prefix_of, response_lens, row_slots], device)
    steps = torch.arange(max(width, response_width), device=device)

    recorded = _RecordKV()
    mask_types = {layer_type: None for layer_type in (getattr(decoder.config, "layer_types", None) or ["full_attention"])}
    prompt_steps = steps[None, :width]
    with route(torch.where(prompt_steps < lens_t[:, None], rep_slots[:, None], -1).reshape(-1)):
        prompt_hidden = decoder(input_ids=input_ids[reps_t, :width], attention_mask=mask_types,
                                position_ids=prompt_steps.expand(num_prefixes, -1), past_key_values=recorded,
                                use_cache=False).last_hidden_state  # [U, P, H]

    positions = row_prompt_lens[:, None] + steps[None, :response_width]  # [B, R]
    responses = input_ids.gather(1, positions.clamp(max=input_ids.shape[1] - 1))
    prefix_visible = prompt_steps < row_prompt_lens[:, None]  # [B, P]
    causal = steps[None, :response_width] <= steps[:response_width, None]  # [R, R]
    mask = torch.cat([prefix_visible[:, None, :].expand(-1, response_width, -1),
                      causal[None].expand(len(prefix_of), -1, -1)], dim=2)[:, None]  # [B, 1, R, P + R]
    response_steps = steps[None, :response_width]
    with route(torch.where(response_steps < row_response_lens[:, None], row_slots_t[:, None], -1).reshape(-1)):
        response_hidden = decoder(input_ids=responses, attention_mask={layer_type: mask for layer_type in mask_types},
                                  position_ids=positions, past_key_values=_PrefixKV(recorded, row_prefix),
                                  use_cache=False).last_hidden_state  # [B, R, H]
    last_prompt = prompt_hidden[row_prefix, row_prompt_lens - 1]  # [B, H]: predicts response token 0
    return torch.cat([last_prompt[:, None], response_hidden[:, : response_width - 1]], dim=1)
