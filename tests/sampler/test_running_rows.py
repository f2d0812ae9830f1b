"""The engine's per-row tables (skyrl_clora.sampler.running_rows): a step's acceptance of sampled tokens, and the
inputs of a step launched while the step before it is still in flight."""

from __future__ import annotations

import numpy as np

from skyrl_clora.sampler.requests import SamplingParams
from skyrl_clora.sampler.running_rows import RunningRows
from skyrl_clora.sampler.sampling import request_uniforms

NONE_PENDING = np.zeros(4, dtype=bool)


def test_accept_appends_sets_next_inputs_and_finishes_by_stop_or_length() -> None:
    rows = RunningRows(num_rows=4, max_len=12)
    rows.start(0, prompt_len=5, lora_slot=2, params=SamplingParams(max_tokens=10, stop_token_ids=(99,), seed=11))
    rows.start(1, prompt_len=9, lora_slot=-1, params=SamplingParams(max_tokens=10, temperature=0.0, seed=12))
    widening = SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, stop_token_ids=(98, 99, 97), seed=13)
    rows.start(3, prompt_len=3, lora_slot=0, params=widening)  # widens the stop table
    assert rows.running().tolist() == [0, 1, 3] and not rows.ending(NONE_PENDING).any()
    assert rows.uniforms(np.array([0, 3])).tolist() == request_uniforms([11, 13], [0, 0]).tolist()

    active = np.array([0, 1, 3])
    finished, stopped = rows.accept(active, np.array([5, 6, 7]), np.array([-0.5, -1.0, -1.5]))
    assert finished.size == 0 and not stopped.any()
    tokens, positions, slots = rows.decode_inputs(active, NONE_PENDING)
    assert tokens.tolist() == [5, 6, 7] and slots.tolist() == [2, -1, 0]
    assert positions.tolist() == [5, 9, 3]  # the sampled token sits right after the prompt

    # row 0 draws a stop token; row 1 reaches max_len (9 + 3 = 12); row 3 reaches max_tokens (2)
    finished, stopped = rows.accept(active, np.array([99, 8, 9]), np.array([-0.1, -0.2, -0.3]))
    assert finished.tolist() == [0, 3] and stopped.tolist() == [True, False]
    assert rows.output(0) == ([5, 99], [-0.5, -0.1]) and rows.output(3) == ([7, 9], [-1.5, -0.3])
    assert rows.uniforms(np.array([0])).tolist() == request_uniforms([11], [2]).tolist()
    finished, stopped = rows.accept(np.array([1]), np.array([4]), np.array([-2.0]))
    assert finished.tolist() == [1] and stopped.tolist() == [False] and rows.output(1)[0] == [6, 8, 4]

    rows.release(3)
    assert rows.running().tolist() == [0, 1]


def test_a_row_with_a_token_in_flight_runs_one_position_further() -> None:
    rows = RunningRows(num_rows=4, max_len=32)
    rows.start(0, prompt_len=5, lora_slot=1, params=SamplingParams(max_tokens=10, stop_token_ids=(99,), seed=21))
    rows.start(1, prompt_len=7, lora_slot=2, params=SamplingParams(max_tokens=2, seed=22))
    rows.start(2, prompt_len=6, lora_slot=3, params=SamplingParams(max_tokens=10, seed=23))
    rows.accept(np.array([0, 1, 2]), np.array([40, 41, 42]), np.array([-1.0, -1.0, -1.0]))  # first tokens (prefill)
    # A step drawing each row's second token is in flight for rows 0 and 1; row 2 was just prefilled (not pending).
    pending = np.array([True, True, False, False])
    assert rows.ending(pending).tolist() == [False, True, False, False]  # row 1's second token is its last
    running = rows.running()
    tokens, positions, slots = rows.decode_inputs(running, pending)
    # a pending row's input is its token in flight (0 here: the device supplies it), one position past its last
    # accepted one; row 1 runs once more, at the position after its last token (max_len - 1 at most)
    assert tokens.tolist() == [0, 0, 42] and positions.tolist() == [6, 8, 6] and slots.tolist() == [1, 2, 3]
    # the next step draws row 0's third token and row 2's second
    assert rows.uniforms(np.array([0, 2]), pending).tolist() == request_uniforms([21, 23], [2, 1]).tolist()
    finished, _ = rows.accept(np.array([0, 1]), np.array([50, 51]), np.array([-2.0, -2.0]))  # the step in flight lands
    assert finished.tolist() == [1]
    tokens, positions, _ = rows.decode_inputs(running, NONE_PENDING)  # the same positions, now with the host's tokens
    assert tokens.tolist() == [50, 51, 42] and positions.tolist() == [6, 8, 6]
