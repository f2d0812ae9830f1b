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

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from skyrl_clora.device.staging import lists_to_device
from skyrl_clora.kernels import gather_rows
from skyrl_clora.kernels.layers.gather_ops import inverse_index
from skyrl_clora.trainer.shared_prefix import prompt_representatives

ATTENTION_NAME = "clora_segments"


@dataclass
class SegmentLayout:
    """Attention segments of one flat pass of ``N`` tokens (prompt segments first, then responses).

    Segment ``s`` has ``q_lens[s]`` queries (tokens ``cu_q[s]..cu_q[s+1]-1``) and ``k_lens[s] >= q_lens[s]``
    keys: the pass's keys ``key_index[cu_k[s]..cu_k[s+1]-1]``; its query ``i`` sees its keys ``0..i +
    k_lens[s] - q_lens[s]``. ``cu_q``/``cu_k`` are int32 device tensors ``[S + 1]``."""

    key_index: torch.Tensor  # [sum k_lens] int64: token index of every segment's keys, segment by segment
    gather_starts: torch.Tensor  # [N + 1] and [sum k_lens] int64: key_index's inverse (gather_ops.inverse_index)
    gather_sources: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """``query: [1, H, N, d]``, ``key``/``value: [1, KV, N, d]`` -> ``[1, N, H, d]`` (Hugging Face's layout
        after attention)."""
        q = query[0].transpose(0, 1).contiguous()  # [N, H, d]
        inverse = (self.gather_starts, self.gather_sources)
        k = gather_rows(key[0].transpose(0, 1), self.key_index, *inverse)  # [sum k_lens, KV, d]
        v = gather_rows(value[0].transpose(0, 1), self.key_index, *inverse)
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


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a Python loop."""
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return offsets + np.arange(int(lengths.sum()))


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


def flat_layout(prompt_lens: list[int], response_lens: list[int], row_slots: list[int], prefix_of: list[int],
                response_width: int) -> dict[str, np.ndarray]:
    """The flat pass of :func:`segment_prefix_hidden` as int64 arrays: per token (``N``) its ``rows`` and
    ``columns`` in ``input_ids`` and its LoRA ``slots``; per segment (``S``: the distinct prompts, then every
    row's response) ``q_lens`` and ``k_lens`` with their prefix sums ``cu_q``/``cu_k`` ``[S + 1]``; the keys'
    token indices ``key_index`` segment by segment, with its inverse ``gather_starts`` ``[N + 1]`` /
    ``gather_sources`` (``gather_ops.inverse_index``: which keys each token is); and ``predictors``
    ``[B * response_width]``, the token whose hidden state predicts each response position (the prompt's last
    token for position 0, response token ``j - 1`` for position ``j``, the row's last predictor repeated past
    its response)."""
    reps = np.asarray(prompt_representatives(prefix_of))
    prompt, response = np.asarray(prompt_lens), np.asarray(response_lens)
    prefix, num_rows = np.asarray(prefix_of), len(prompt_lens)
    # The segments: the distinct prompts, then every row's response.
    q_lens = np.concatenate([prompt[reps], response])
    k_lens = np.concatenate([prompt[reps], prompt + response])
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])  # each segment's first token
    prompt_starts, response_starts = cu_q[: len(reps)], cu_q[len(reps) : -1]
    # Flat token list: (row of input_ids, column) per token, its position and its LoRA slot.
    segment_rows = np.concatenate([reps, np.arange(num_rows)])
    rows = np.repeat(segment_rows, q_lens)
    columns = _ranges(np.concatenate([np.zeros(len(reps), dtype=np.int64), prompt]), q_lens)
    slots = np.asarray(row_slots)[rows]
    # Keys: prompt segments see their own tokens; response b sees its prompt's segment, then itself.
    key_starts = np.stack([prompt_starts[prefix], response_starts], axis=1).reshape(-1)
    key_lens = np.stack([prompt, response], axis=1).reshape(-1)
    key_index = np.concatenate([np.arange(cu_q[len(reps)]), _ranges(key_starts, key_lens)])
    # Hidden state predicting response token j: the prompt's last token for j = 0, response token j - 1 after
    # (repeating the last one past the row's response).
    last_prompt = prompt_starts[prefix] + prompt - 1
    own = np.minimum(response, response_width)  # response tokens predicted inside the width
    steps = np.arange(response_width)[None]
    predictors = np.where((steps == 0) | (own[:, None] < 2), last_prompt[:, None],
                          response_starts[:, None] + np.minimum(steps, own[:, None] - 1) - 1).reshape(-1)
    gather_starts, gather_sources = inverse_index(key_index, int(cu_q[-1]))
    return {"rows": rows, "columns": columns, "slots": slots, "key_index": key_index, "gather_starts": gather_starts,
            "gather_sources": gather_sources, "q_lens": q_lens,
            "k_lens": k_lens, "cu_q": cu_q, "cu_k": np.concatenate([[0], np.cumsum(k_lens)]), "predictors": predictors}


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
    layout = flat_layout(prompt_lens, response_lens, row_slots, prefix_of, response_width)
    names = ("rows", "columns", "slots", "key_index", "gather_starts", "gather_sources", "cu_q", "cu_k", "predictors")
    rows_t, columns_t, slots_t, key_index_t, starts_t, sources_t, cu_q_t, cu_k_t, predictors_t = lists_to_device(
        [layout[name] for name in names], input_ids.device)
    segments = SegmentLayout(key_index_t, starts_t, sources_t, cu_q_t.int(), cu_k_t.int(), layout["q_lens"].tolist(),
                             layout["k_lens"].tolist())
    tokens = input_ids[rows_t, columns_t][None]  # [1, N]
    mask_types = getattr(decoder.config, "layer_types", None) or ["full_attention"]
    with _segment_attention(decoder), route(slots_t):
        hidden = decoder(input_ids=tokens, position_ids=columns_t[None], attention_mask={t: segments for t in mask_types},
                         use_cache=False).last_hidden_state[0]  # [N, H]
    return hidden.index_select(0, predictors_t).view(len(prefix_of), response_width, -1)

