"""The sampling engine's counters (``Engine.stats``): where its thread's time and tokens went."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since start: decode steps, admission rounds that prefilled (one batched prefill call
    each), tokens generated, prompt tokens computed by prefill and prompt tokens served from the prefix
    cache, seconds spent in prefill (with its sampling and first-use graph captures), in decode steps (with
    their sampling) and busy in all, the seconds the loop waited while paused and while it had nothing to do
    (no running row, request or publish; busy + paused + idle is the engine thread's lifetime, up to the
    loop's own bookkeeping; a wait counts by the state it began in, so a pause that starts while the loop
    has nothing to do adds to idle; idle waits of 1 ms or more are counted and the longest kept, a wait ending
    at the first request or publish, or after 0.5 s), the seconds decode steps spent in their sampling call
    (which waits for the step's GPU work: the rest of a decode step is host work), of the rest the seconds
    decode steps spent staging their inputs (choosing rows, shared-prefix sources, copies to the device) and
    launching the step (a CUDA-graph replay, or the eager forward on the CPU), the seconds spent retiring
    finished requests (storing their K/V history, completing their futures; in decode steps and prefill), the
    seconds the decode CUDA graphs' capture took, and the key positions decode steps read from another row's
    copy of a shared prefix."""

    decode_steps: int = 0
    prefill_rounds: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_sampling_seconds: float = 0.0
    decode_input_seconds: float = 0.0
    decode_launch_seconds: float = 0.0
    retire_seconds: float = 0.0
    busy_seconds: float = 0.0
    paused_seconds: float = 0.0
    idle_seconds: float = 0.0
    idle_waits: int = 0
    longest_idle_seconds: float = 0.0
    graph_capture_seconds: float = 0.0
    shared_prefix_positions: int = 0  # decode-step key positions read from another row's copy
