"""The one-pass shared-prompt forward (:mod:`skyrl_clora.trainer.prompt_segments`: prompt and response segments of
one flat sequence) against every row running its whole sequence: hidden states and LoRA gradients, with two
tenants' adapters in one pass; the segments' reference attention, and the flat layout against its loop form."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from skyrl_clora.kernels.layers.gather_ops import inverse_index
from skyrl_clora.trainer.prompt_segments import SegmentLayout, flat_layout, segment_prefix_hidden
from skyrl_clora.trainer.shared_prefix import prompt_representatives
from tests.support.shared_prompt_rows import assert_matches_whole_sequences


def test_segments_match_whole_sequences_in_values_and_gradients(micro_model_dir: Path) -> None:
    assert_matches_whole_sequences(micro_model_dir, segment_prefix_hidden)


def test_layout_reference_attends_bottom_right_within_segments() -> None:
    """Two segments: 2 queries over 3 keys, then 1 query over 1 key; query i of a segment sees its keys up to
    i + (keys - queries). Checked against per-segment attention computed by hand."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=generator)  # [1, H, N, d]
    k = torch.randn(1, 1, 3, 4, generator=generator)
    v = torch.randn(1, 1, 3, 4, generator=generator)
    starts, sources = (torch.from_numpy(a) for a in inverse_index(np.array([0, 1, 2, 2]), 3))
    layout = SegmentLayout(key_index=torch.tensor([0, 1, 2, 2]), gather_starts=starts, gather_sources=sources,
                           cu_q=torch.tensor([0, 2, 3], dtype=torch.int32), cu_k=torch.tensor([0, 3, 4], dtype=torch.int32),
                           q_lens=[2, 1], k_lens=[3, 1])
    out = layout.attend(q, k, v, scale=0.5)[0]  # [N, H, d]

    def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.softmax(query @ keys.T * 0.5, dim=-1) @ values

    keys, values = k[0, 0], v[0, 0]
    for head in range(2):
        torch.testing.assert_close(out[0, head], attend(q[0, head, 0], keys[:2], values[:2]))
        torch.testing.assert_close(out[1, head], attend(q[0, head, 1], keys[:3], values[:3]))
        torch.testing.assert_close(out[2, head], attend(q[0, head, 2], keys[2:3], values[2:3]))


def _flat_layout_loops(prompt_lens, response_lens, row_slots, prefix_of, response_width):
    """The flat pass written out with Python loops (the form ``flat_layout`` vectorises)."""
    reps = prompt_representatives(prefix_of)
    q_lens = [prompt_lens[rep] for rep in reps] + list(response_lens)
    k_lens = [prompt_lens[rep] for rep in reps] + [p + r for p, r in zip(prompt_lens, response_lens)]
    cu_q = [0]
    for length in q_lens:
        cu_q.append(cu_q[-1] + length)
    prompt_starts, response_starts = cu_q[: len(reps)], cu_q[len(reps) : -1]
    rows, columns = [], []
    for rep in reps:
        rows += [rep] * prompt_lens[rep]
        columns += range(prompt_lens[rep])
    for row, (start, length) in enumerate(zip(prompt_lens, response_lens)):
        rows += [row] * length
        columns += range(start, start + length)
    key_index = list(range(cu_q[len(reps)]))
    for row, length in enumerate(response_lens):
        prefix_start = prompt_starts[prefix_of[row]]
        key_index += range(prefix_start, prefix_start + prompt_lens[row])
        key_index += range(response_starts[row], response_starts[row] + length)
    predictors = []
    for row, length in enumerate(response_lens):
        last_prompt = prompt_starts[prefix_of[row]] + prompt_lens[row] - 1
        own = [response_starts[row] + j - 1 for j in range(1, min(length, response_width))]
        predictors += [last_prompt] + own + [own[-1] if own else last_prompt] * (response_width - 1 - len(own))
    gatherers: list[list[int]] = [[] for _ in range(cu_q[-1])]  # per token, the key positions that are it
    for position, token in enumerate(key_index):
        gatherers[token].append(position)
    gather_starts = [0]
    for positions in gatherers:
        gather_starts.append(gather_starts[-1] + len(positions))
    return {"rows": rows, "columns": columns, "slots": [row_slots[row] for row in rows], "key_index": key_index,
            "gather_starts": gather_starts, "gather_sources": [p for positions in gatherers for p in positions],
            "q_lens": q_lens, "k_lens": k_lens, "cu_q": cu_q, "predictors": predictors}


def test_flat_layout_equals_its_loop_form() -> None:
    gen = torch.Generator().manual_seed(9)
    prefix_of = [0, 0, 1, 2, 2, 2, 1, 3]  # a prompt's rows need not be adjacent
    prompt_of = [int(n) for n in torch.randint(1, 30, (4,), generator=gen)]
    prompt_lens = [prompt_of[p] for p in prefix_of]
    response_lens = [0, 1, 2, 17, 5, 30, 9, 12]  # empty, one token, and one past the width below
    row_slots = [1, 1, 0, 2, 2, 2, 0, 1]
    got = flat_layout(prompt_lens, response_lens, row_slots, prefix_of, response_width=20)
    want = _flat_layout_loops(prompt_lens, response_lens, row_slots, prefix_of, response_width=20)
    for name, values in want.items():
        assert got[name].tolist() == values, name
    assert got["cu_k"].tolist()[-1] == len(want["key_index"])
