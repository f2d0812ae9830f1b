"""The trainer's one-pass forward for micro-batches whose rows share prompts (the GPU form of
``shared_prefix``): every distinct prompt and every row's response run as segments of one flat sequence.

GRPO draws several samples per prompt. ``shared_prefix`` computes each prompt once in a second decoder
pass; on a GPU the trainer is bound by the host's launches (an eager pass of a 28-layer model with
multi-LoRA layers costs about as much host time as its kernels take), so a second pass costs what the
shared prompt saves. Here one pass of ``[1, N]`` tokens holds ``U`` prompt segments (the distinct prompts)
followed by ``B`` response segments (each row's real response tokens, no padding), with per-token positions
and LoRA slots; only attention sees the segments (:class:`SegmentLayout`, passed to the Hugging Face
decoder as its attention mask under the :data:`ATTENTION_NAME` implementation):

- a prompt segment attends causally to itself;
- response segment ``b`` attends to its prompt's segment (keys and values gathered in front of its own,
  so their gradients sum over the rows of a prompt) and causally to itself.

That is variable-length causal attention with the causal diagonal at the bottom right of each segment's
``[queries, keys]`` block: one flash-attention call on bf16/fp16 CUDA tensors; elsewhere a masked-SDPA
reference over a dense ``[N, N]`` mask, for tests (the trainer takes the two-pass form there). A token's
hidden state equals the one a whole-sequence pass of its row computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from skyrl_clora.device_copy import lists_to_device
from skyrl_clora.trainer.shared_prefix import prompt_representatives

ATTENTION_NAME = "clora_segments"


@dataclass
class SegmentLayout:
    """Attention segments of one flat pass of ``N`` tokens (prompt segments first, then responses).

    Segment ``s`` has ``q_lens[s]`` queries (tokens ``cu_q[s]..cu_q[s+1]-1``) and ``k_lens[s] >= q_lens[s]``
    keys: the pass's keys ``key_index[cu_k[s]..cu_k[s+1]-1]``; its query ``i`` sees its keys ``0..i +
    k_lens[s] - q_lens[s]``. ``cu_q``/``cu_k`` are int32 device tensors ``[S + 1]``."""

    key_index: torch.Tensor  # [sum k_lens] int64: token index of every segment's keys, segment by segment
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """``query: [1, H, N, d]``, ``key``/``value: [1, KV, N, d]`` -> ``[1, N, H, d]`` (Hugging Face's layout
        after attention)."""
        q = query[0].transpose(0, 1).contiguous()  # [N, H, d]
        k = key[0].transpose(0, 1).index_select(0, self.key_index)  # [sum k_lens, KV, d]
        v = value[0].transpose(0, 1).index_select(0, self.key_index)
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, self.cu_q, self.cu_k, max(self.q_lens), max(self.k_lens), 0.0, True, False, scale=scale)[0]
        else:
            out = self._attend_reference(q, k, v, scale)
        return out.unsqueeze(0)

    def _attend_reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """The same attention as one masked SDPA call over all segments: ``[N, H, d]``."""
        device = q.device
        q_seg = torch.repeat_interleave(torch.arange(len(self.q_lens), device=device), torch.tensor(self.q_lens, device=device))
        k_seg = torch.repeat_interleave(torch.arange(len(self.k_lens), device=device), torch.tensor(self.k_lens, device=device))
        q_pos = torch.arange(q.shape[0], device=device) - self.cu_q[:-1].long()[q_seg]
        k_pos = torch.arange(k.shape[0], device=device) - self.cu_k[:-1].long()[k_seg]
        offset = (self.cu_k.diff() - self.cu_q.diff()).long()[q_seg]  # keys a segment's first query sees, minus 1
        visible = (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None] + offset[:, None])
        groups = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(groups, dim=1).transpose(0, 1),
            v.repeat_interleave(groups, dim=1).transpose(0, 1), attn_mask=visible, scale=scale)
        return out.transpose(0, 1)


def segment_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: object, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Hugging Face attention function: a :class:`SegmentLayout` mask attends by segments, anything else is
    Hugging Face's SDPA attention."""
    if isinstance(attention_mask, SegmentLayout):
        return attention_mask.attend(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION_NAME, segment_attention)


@contextlib.contextmanager
def _segment_attention(decoder: nn.Module) -> Iterator[None]:
    """Runs the decoder's attention layers through :func:`segment_attention` (the backward keeps the graph
    recorded here; the config is restored on exit)."""
    config = decoder.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def segment_prefix_hidden(
    decoder: nn.Module,
    route: Callable[[torch.Tensor], contextlib.AbstractContextManager],
    input_ids: torch.Tensor,
    prompt_lens: list[int],
    response_lens: list[int],
    row_slots: list[int],
    prefix_of: list[int],
    response_width: int,
) -> torch.Tensor:
    """Final hidden states ``[B, response_width, H]`` predicting each row's response tokens (same contract
    as ``shared_prefix.shared_prefix_hidden``).

    ``input_ids: [B, W]`` holds each row's prompt then response (right-padded); row ``b`` has a prompt of
    ``prompt_lens[b]`` and a response of ``response_lens[b]`` tokens, uses LoRA slot ``row_slots[b]`` and
    shares its prompt with every row of the same ``prefix_of[b]`` (``0..U-1``; rows of one prompt must
    have the same prompt tokens and slot). ``route(token_slots)`` routes the pass's tokens to their slots.
    Entries past a row's response hold the hidden state of its last token, which the caller masks out."""
    device = input_ids.device
    reps = prompt_representatives(prefix_of)
    q_lens = [prompt_lens[rep] for rep in reps] + list(response_lens)  # the segments: prompts, then responses
    k_lens = [prompt_lens[rep] for rep in reps] + [p + r for p, r in zip(prompt_lens, response_lens)]
    cu_q = list(accumulate(q_lens, initial=0))  # each segment's first token
    prompt_starts, response_starts, responses_from = cu_q[: len(reps)], cu_q[len(reps) : -1], cu_q[len(reps)]
    # Flat token list: (row of input_ids, column) per token, its position and its LoRA slot.
    rows, columns, slots = [], [], []
    for rep in reps:
        rows += [rep] * prompt_lens[rep]
        columns += range(prompt_lens[rep])
        slots += [row_slots[rep]] * prompt_lens[rep]
    for row, (start, length) in enumerate(zip(prompt_lens, response_lens)):
        rows += [row] * length
        columns += range(start, start + length)
        slots += [row_slots[row]] * length
    key_index: list[int] = list(range(responses_from))  # prompt segments see their own tokens
    for row, length in enumerate(response_lens):
        prefix_start = prompt_starts[prefix_of[row]]
        key_index += range(prefix_start, prefix_start + prompt_lens[row])
        key_index += range(response_starts[row], response_starts[row] + length)
    # Hidden state predicting response token j: the prompt's last token for j = 0, response token j - 1 after.
    predictors = []
    for row, length in enumerate(response_lens):
        last_prompt = prompt_starts[prefix_of[row]] + prompt_lens[row] - 1
        own = [response_starts[row] + j - 1 for j in range(1, min(length, response_width))]
        predictors += [last_prompt] + own + [own[-1] if own else last_prompt] * (response_width - 1 - len(own))
    rows_t, columns_t, slots_t, key_index_t, cu_q, cu_k, predictors_t = lists_to_device(
        [rows, columns, slots, key_index, cu_q, list(accumulate(k_lens, initial=0)), predictors], device)
    layout = SegmentLayout(key_index_t, cu_q.int(), cu_k.int(), q_lens, k_lens)
    tokens = input_ids[rows_t, columns_t][None]  # [1, N]
    mask_types = getattr(decoder.config, "layer_types", None) or ["full_attention"]
    with _segment_attention(decoder), route(slots_t):
        hidden = decoder(input_ids=tokens, position_ids=columns_t[None], attention_mask={t: layout for t in mask_types},
                         use_cache=False).last_hidden_state[0]  # [N, H]
    return hidden.index_select(0, predictors_t).view(len(prefix_of), response_width, -1)

