"""The engine's per-cache-row state of running requests, as numpy tables.

A decode step samples every running row at once; what the host then does per row (draw its RNG number,
append the sampled token, check stop tokens and length limits, set the next input) would be a Python loop of
a few microseconds per row: host time between two GPU steps that grows with the rows (and GIL time taken from
the trainer's thread; ``benchmarks.engine_host`` times it). Here those are a handful of vectorised operations per
step; only the rows that finish go through Python, to hand their outputs back.
"""

from __future__ import annotations

import numpy as np

from skyrl_clora.sampler.requests import SamplingParams
from skyrl_clora.sampler.sampling import request_uniforms


class RunningRows:
    """Tables over ``num_rows`` cache rows (row ``r`` holds one request at a time, between :meth:`start` and
    :meth:`release`):

    - ``active[r]`` and the row's LoRA slot ``lora[r]`` (``-1``: none);
    - the sampling settings: ``seed``, ``temperature``, ``top_p``;
    - the progress: ``prompt_len``, ``drawn`` (tokens sampled so far), ``limit`` (the most it may sample:
      ``min(max_tokens, max_len - prompt_len)``), ``stop`` (its stop token ids, padded with -1);
    - the outputs so far: ``out_tokens[r, :drawn[r]]`` and ``out_logprobs[r, :drawn[r]]``.

    A running row's decode input (:meth:`decode_inputs`) follows from these: its last sampled token, at
    position ``prompt_len + drawn - 1`` (one further while the engine's step in flight draws its next one).
    """

    def __init__(self, num_rows: int, max_len: int) -> None:
        self.max_len = max_len
        self.active = np.zeros(num_rows, dtype=bool)
        self.lora = np.full(num_rows, -1, dtype=np.int64)
        self.seed = np.zeros(num_rows, dtype=np.uint64)
        self.temperature = np.zeros(num_rows, dtype=np.float32)
        self.top_p = np.ones(num_rows, dtype=np.float32)
        self.prompt_len = np.zeros(num_rows, dtype=np.int64)
        self.drawn = np.zeros(num_rows, dtype=np.int64)
        self.limit = np.zeros(num_rows, dtype=np.int64)
        self.stop = np.full((num_rows, 1), -1, dtype=np.int64)
        self.out_tokens = np.zeros((num_rows, max_len), dtype=np.int64)
        self.out_logprobs = np.zeros((num_rows, max_len), dtype=np.float64)

    def start(self, row: int, prompt_len: int, lora_slot: int, params: SamplingParams) -> None:
        """Row ``row`` now runs a request with a ``prompt_len``-token prompt in LoRA slot ``lora_slot`` (-1: none),
        sampled with ``params`` (its first token not drawn yet)."""
        stop_token_ids = params.stop_token_ids
        if len(stop_token_ids) > self.stop.shape[1]:
            wider = np.full((self.stop.shape[0], len(stop_token_ids)), -1, dtype=np.int64)
            wider[:, : self.stop.shape[1]] = self.stop
            self.stop = wider
        self.active[row] = True
        self.lora[row] = lora_slot
        self.seed[row] = params.seed & 0xFFFFFFFFFFFFFFFF
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.prompt_len[row] = prompt_len
        self.drawn[row] = 0
        self.limit[row] = min(params.max_tokens, self.max_len - prompt_len)
        self.stop[row] = -1
        self.stop[row, : len(stop_token_ids)] = stop_token_ids

    def release(self, row: int) -> None:
        self.active[row] = False

    def ending(self, pending: np.ndarray) -> np.ndarray:
        """Which rows' token in flight is certain to be their last (``[num_rows]`` bool): ``pending[r]`` marks a
        row whose token from the engine's step in flight (launched, not yet accepted) is still to come; with it
        the row reaches its length limit. (Whether a token in flight is a stop token is not known yet.)"""
        return pending & (self.drawn + 1 >= self.limit)

    def decode_inputs(self, rows: np.ndarray, pending: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The running rows ``rows``' decode inputs ``(tokens, positions, lora slots)``, in that order: each row's last
        sampled token at position ``prompt_len + drawn - 1`` and its slot; if ``pending[row]``, its token in flight,
        one position further (the token is the caller's to supply on the device: here 0). That position is at most
        ``max_len - 1`` and past what the row keeps, so a row whose token in flight turns out to be its last may run
        once more (its new token is dropped)."""
        in_flight = pending[rows]
        drawn = self.drawn[rows] + in_flight
        last = self.out_tokens[rows, np.maximum(drawn - 1, 0)]
        return np.where(in_flight, 0, last), self.prompt_len[rows] + drawn - 1, self.lora[rows]

    def running(self) -> np.ndarray:
        """The running rows, ascending (int64)."""
        return np.flatnonzero(self.active)

    def uniforms(self, rows: np.ndarray, pending: np.ndarray | None = None) -> np.ndarray:
        """Each row's RNG draw for its next token (:func:`request_uniforms` of its seed and ``drawn``, plus one
        for a row whose token in flight is ``pending``, over all rows)."""
        drawn = self.drawn[rows] if pending is None else self.drawn[rows] + pending[rows]
        return request_uniforms(self.seed[rows], drawn)

    def accept(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Appends ``tokens[i]`` (log-prob ``logprobs[i]``) to row ``rows[i]``'s output. Returns the rows that
        finished and, for each, whether by a stop token (else by their length limit)."""
        drawn = self.drawn[rows]
        self.out_tokens[rows, drawn] = tokens
        self.out_logprobs[rows, drawn] = logprobs
        drawn += 1
        self.drawn[rows] = drawn
        stopped = (self.stop[rows] == tokens[:, None]).any(axis=1)
        finished = stopped | (drawn >= self.limit[rows])
        return rows[finished], stopped[finished]

    def output(self, row: int) -> tuple[list[int], list[float]]:
        """Row ``row``'s sampled tokens and their log-probs so far."""
        count = int(self.drawn[row])
        return self.out_tokens[row, :count].tolist(), self.out_logprobs[row, :count].tolist()
