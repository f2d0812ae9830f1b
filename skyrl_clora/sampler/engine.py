"""The embedded multi-LoRA sampling engine: continuous batching across tenants over one base model.

:class:`Engine` executes; one thread runs it (:class:`~skyrl_clora.sampler.engine_thread.EngineThread`, which
holds it, owns its inbox and is the thread-safe API). Each round (:meth:`Engine.step`):
  1. (the thread) hands it the new requests and adapter publishes of its inbox;
  2. applies every pending publish whose adapter has no running request (the version fence: a request
     is sampled entirely with the adapter version it was admitted under; new requests of an adapter with
     a pending publish wait until it lands, so a publish cannot starve): the adapter's host copy becomes the
     published one, and its device slot, if it holds one, is written from it;
  3. admits waiting requests into free cache rows (FIFO over all tenants, or the least served tenant first with
     ``config.admission="fair"``, while the KV block pool has room and
     each one's adapter holds or can be given one of the bounded device slots: :class:`AdapterSlots`, a cache
     over the adapters' host copies, least recently used out), writes the adapters given a slot into it
     and prefills the requests together (ragged passes, replayed from CUDA graphs on the GPU), each row starting with
     the keyed prompt blocks of its adapter version it can share (and, with ``reuse_decode_kv``, a finished
     turn's whole history when the prompt extends it: the next turn of a multi-turn episode then computes only
     its new tokens), by reference: :class:`BlockManager`;
  4. launches one decode step for the running rows, packed at the front of the batch whichever cache rows
     they hold (a CUDA-graph replay on the GPU, sized by how many run, not by the highest row running), and its
     sampling of every running row at once (each with its own counter-based RNG, see
     ``sampling``), then accepts the tokens of the step launched before it and the first tokens of the
     rows prefilled in step 3, and retires the finished requests, resolving their futures. The host thus
     works on step t's tokens while the GPU runs step t+1, whose rows of step t (and rows just prefilled)
     take their input tokens from the device; a prefill never waits for the decode step ahead of it. A row
     whose step-t token ends it (a stop token, or its length limit while other rows go on) runs once more
     at t+1, and that token is dropped.
Which publishes land, which waiting requests take which rows, KV blocks and adapter slots (a :class:`PrefillPlan`)
and, before each decode step, which running request is preempted when the pool has no block left (the most recently
admitted one: it waits first in the queue to start over, its tokens drawn again from the same counter-based RNG)
is the :class:`Scheduler`'s decision, and only the scheduler changes the block pool's state and the slots' residency
(schedule -> execute -> update): the engine writes adapters into their slots, copies KV blocks as a plan says, runs
the passes (:class:`ModelRunner`), samples, and reports to the scheduler what it prefilled and retired.
Other tenants' requests keep decoding while one tenant's adapter is published: a publish is a ``copy_``
into that tenant's slot between two decode steps (dropping only that tenant's cached prefixes), never a
pause or a global cache reset.
Timers and counters go to a :class:`StatsRecorder` (``Engine.stats``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from skyrl_clora.device.staging import lists_to_device
from skyrl_clora.lora.layers import MultiLoRALinear
from skyrl_clora.device.profiling import profiled
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.block_manager import BlockManager
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_stats import EngineStats, GPUSpan, StatsRecorder
from skyrl_clora.sampler.fair_share import slot_credit
from skyrl_clora.sampler.model_runner import DECODE_ROW_QUANTUM, ModelRunner, PrefillJob
from skyrl_clora.sampler.requests import Completion, PrefillPlan, Publish, QueuedRequest, Unregister
from skyrl_clora.sampler.running_rows import RunningRows
from skyrl_clora.sampler.sampling import DrawnTokens, draw_rows
from skyrl_clora.sampler.scheduler import Scheduler
from skyrl_clora.sampler.shared_rows import SharedPrefixRows


@dataclass
class _StepInFlight:
    """A decode step or prefill launched with its sampling, its tokens not accepted yet: its cache rows
    (ascending for a decode step), the request each row held at launch, the drawn tokens (one per row), its
    forward pass's GPU span and, for a prefill, the span of its block copies. The spans are read once the
    tokens are (reading one waits for the GPU to reach its end)."""

    rows: np.ndarray
    requests: list[QueuedRequest]
    drawn: DrawnTokens
    forward: GPUSpan
    copied: GPUSpan | None = None


class Engine:
    """Multi-tenant sampler (see module docstring) of ``config`` on ``model`` and its engine LoRA layers
    (``attach_engine_lora``). Not thread-safe: one thread calls :meth:`step` (an
    :class:`~skyrl_clora.sampler.engine_thread.EngineThread`, or a benchmark driving the rounds itself) and hands
    it work through ``scheduler.enqueue``; ``stats`` and :meth:`running_rows` may be read from any thread.

    ``max_len`` and the row count are ``config``'s rounded up to whole blocks and decode row quanta."""

    def __init__(self, model: torch.nn.Module, lora_layers: dict[str, MultiLoRALinear], config: EngineConfig) -> None:
        self.config = config
        block_size = config.block_size
        max_len = -(-config.max_len // block_size) * block_size  # whole prefill blocks
        num_rows = -(-config.num_rows // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM
        num_blocks = config.num_blocks or 2 * num_rows * (max_len // block_size)
        self.runner = ModelRunner(model, num_rows=num_rows, max_len=max_len, block_size=block_size,
                                  prefill_tokens=config.max_prefills_per_step * block_size, num_blocks=num_blocks,
                                  share_prefix_reads=config.share_prefix_reads, kv_dtype=config.kv_dtype)
        self._shared_rows = SharedPrefixRows(num_rows) if config.share_prefix_reads else None
        blocks = BlockManager(num_blocks, block_size, num_rows, max_len // block_size, config.cache_prefixes)
        self.lora_layers = lora_layers
        self.adapters = AdapterSlots(lora_layers, pin=self.runner.device.type == "cuda")
        self.max_len = max_len
        self.recorder = StatsRecorder(self.runner.device)
        if config.cuda_graphs and self.runner.device.type == "cuda":
            self.recorder.graphs_captured(self.runner.capture_graphs())
        self.scheduler = Scheduler(num_rows, self.adapters, blocks, config.max_prefills_per_step,
                                   config.reuse_decode_kv and config.cache_prefixes, config.prefill_wait_steps,
                                   config.admission, slot_credit(max_len), config.reserve_kv)
        self._running = RunningRows(num_rows, max_len)  # per cache row: decode inputs, settings, outputs so far
        self._in_flight: _StepInFlight | None = None  # the decode step launched last
        self._prefilled: _StepInFlight | None = None  # this round's prefill, its first tokens not accepted yet

    @property
    def stats(self) -> EngineStats:
        """The engine's counters (``recorder.stats``; a live view from any thread)."""
        return self.recorder.stats

    def running_rows(self) -> int:
        """How many requests hold a row now (read from any thread: a snapshot)."""
        return int(np.count_nonzero(self._running.active))

    def has_step_in_flight(self) -> bool:
        """Whether a launched decode step's tokens are not accepted yet."""
        return self._in_flight is not None

    def finish_step_in_flight(self) -> None:
        """Accepts the tokens of the decode step in flight (before a pause: nothing new is launched)."""
        self._accept_in_flight(self._held(self._in_flight))

    def fail(self, error: Exception) -> None:
        """Fails every running request with ``error`` (a round broke) and forgets the steps in flight."""
        self._in_flight = self._prefilled = None
        for req in self.scheduler.running():
            self._free_row(req.row)
            if not req.future.done():
                req.future.set_exception(error)

    def step(self) -> None:
        """One round: applies the publishes that may land, prefills the requests the scheduler admits, launches
        the next decode step and accepts the one before."""
        self._apply_publishes(self.scheduler.ready_publishes())
        self._admit(self.scheduler.schedule_prefill())
        self._decode()

    def _apply_publishes(self, publishes: list[Publish | Unregister]) -> None:
        """Applies the publishes and unregisters the scheduler lets land now (:meth:`Scheduler.ready_publishes`);
        a failed one fails its own future."""
        for publish in publishes:
            try:
                if isinstance(publish, Unregister):
                    self.scheduler.unregister(publish.adapter)
                else:
                    self.adapters.publish(publish.adapter, publish.weights, publish.version)
                publish.future.set_result(None)
            except Exception as error:
                publish.future.set_exception(error)

    @profiled("engine.admit")
    def _admit(self, plan: PrefillPlan) -> None:
        """Loads the adapters ``plan`` gave device slots (their latest host copies) and prefills its requests in one
        batched call; a failed load or prefill fails the plan's requests, not the running ones, and the adapters it
        loaded give their slots back (loaded again when next needed)."""
        self.recorder.adapters_scheduled(plan.hits, len(plan.loads), plan.evictions)
        if not plan.requests and not plan.loads:
            return
        try:
            for name in plan.loads:
                self.adapters.load(name)
            if plan.requests:
                self._prefill(plan)
        except Exception as error:  # a failed prefill fails its own requests, not the running ones
            self.scheduler.unload(plan.loads)
            for req in plan.requests:
                if self.scheduler.rows[req.row] is req:
                    self._free_row(req.row)
                else:
                    self.scheduler.release(req.row)
                if not req.future.done():
                    req.future.set_exception(error)

    @profiled("engine.prefill")
    def _prefill(self, plan: PrefillPlan) -> None:
        """Copies the shared blocks ``plan``'s rows write into, prefills its requests (each from its start), starts
        their rows and samples their first tokens."""
        started = time.perf_counter()
        ready = plan.requests
        prompts = lists_to_device([req.prompt_ids for req in ready], self.runner.device)
        jobs = [PrefillJob(req.row, tokens, req.lora_slot, start=start)
                for req, tokens, start in zip(ready, prompts, plan.starts)]
        with GPUSpan(self.runner.device) as copied:  # copies of shared blocks a row writes into
            if plan.copies[0]:
                self.runner.copy_blocks(*plan.copies)
            self._sync_tables()
        with GPUSpan(self.runner.device) as forward:
            logits = torch.stack(self.runner.prefill(jobs))
        for req, start in zip(ready, plan.starts):
            req.admitted = started
            self.scheduler.prefilled(req, start)
            self._start_row(req)
        rows = np.array([req.row for req in ready], dtype=np.int64)
        drawn = self._draw(rows, logits)
        self.runner.record_sampled(lists_to_device([rows], logits.device)[0], drawn.tokens)
        self._prefilled = _StepInFlight(rows, ready, drawn, forward, copied)
        computed = sum(len(req.prompt_ids) for req in ready) - sum(plan.starts)
        self.recorder.prefill_launched(started, computed, sum(plan.starts), self.scheduler.blocks.held_blocks())

    def _start_row(self, request: QueuedRequest) -> None:
        """Makes ``request`` (placed by the scheduler) run in its cache row, its first token not drawn yet."""
        if self._shared_rows is not None:
            self._shared_rows.assign(request.row, self.scheduler.blocks.identity(request.row))
        self._running.start(request.row, len(request.prompt_ids), request.lora_slot, request.params)
        self.recorder.row_started(self.running_rows())

    def _sync_tables(self) -> None:
        """Copies the block tables to the device if they changed (ordered after the work queued before)."""
        tables = self.scheduler.changed_tables()
        if tables is not None:
            self.runner.set_block_tables(tables)

    def _decode(self) -> None:
        """Launches the next decode step (if a row runs), then accepts the step in flight before it and this
        round's prefilled first tokens. Which rows of the step in flight still hold its requests is found once,
        and again only if the launch stopped rows (a preemption): nothing else admits or retires in between (a
        row retired at the last accept and admitted again holds a new request, whose token in flight is the
        prefill's)."""
        step, prefilled = self._in_flight, self._prefilled
        pending = np.zeros(self.runner.num_rows, dtype=bool)  # rows whose token in flight is to come
        held = None if step is None else self._held(step)
        if step is not None:
            pending[step.rows[held]] = True
        if prefilled is not None:
            pending[prefilled.rows] = True
        launched, stopped = self._launch_decode(pending) if any(self.scheduler.rows) else (None, False)
        if step is not None:
            if stopped:  # a stopped row's token in flight is not its own any more
                held &= self._held(step)
            self._accept_in_flight(held)
        if prefilled is not None:
            self._accept_prefilled()
        self._in_flight = launched

    @profiled("engine.decode_step")
    def _launch_decode(self, pending: np.ndarray) -> tuple[_StepInFlight | None, bool]:
        """Launches a decode step and its sampling for the running rows, packed at the front of the batch whichever
        cache rows they hold and padded with idle positions to whole row quanta, without waiting for the GPU,
        after the scheduler gave every running row the block the step writes into
        (:meth:`Scheduler.make_room`, which may preempt). The ``pending`` rows (``[num_rows]`` bool: those of the
        step in flight that still hold its requests) take their input tokens from its draw on the device.
        Returns the step (None, launching nothing, when every running row's token in flight is certain to be its
        last, or no row runs any more) and whether rows were stopped for want of blocks."""
        started = time.perf_counter()
        running = self._running
        if not (running.active & ~running.ending(pending)).any():
            return None, False
        rows = running.running()
        positions = running.prompt_len[rows] + running.drawn[rows] + pending[rows] - 1
        preempted, failed = self.scheduler.make_room(rows, positions // self.scheduler.blocks.block_size + 1)
        for row in preempted + failed:
            self._stop_row(row)
        self.recorder.preempted(len(preempted))
        rows = running.running()
        if not rows.size:  # every running request was preempted or failed
            return None, bool(preempted or failed)
        self._sync_tables()
        count = rows.size
        span = min(self.runner.num_rows, -(-count // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM)
        idle = span - count  # positions padding the batch to whole quanta: the scratch row at position 0
        prefix_rows = prefix_lens = None
        shared_positions = 0
        if self._shared_rows is not None:
            prefix_rows, prefix_lens = self._shared_rows.sources(rows, span)
            shared_positions = self._shared_rows.borrowed_positions
        tokens, positions, slots = running.decode_inputs(rows, pending)
        pad = np.zeros(idle, dtype=np.int64)
        self.runner.set_decode_inputs(
            np.concatenate([tokens, pad]), np.concatenate([positions, pad]), np.concatenate([slots, pad - 1]),
            prefix_rows, prefix_lens, from_sampled=np.concatenate([pending[rows], pad]),
            rows=np.concatenate([rows, pad + self.runner.scratch_row]))
        staged = time.perf_counter()
        with GPUSpan(self.runner.device) as forward:
            logits = self.runner.decode(span)
        drawn = self._draw(rows, logits[:count], pending)
        self.runner.record_sampled(self.runner.decode_rows[:count], drawn.tokens)  # the rows this step staged
        self.recorder.decode_launched(started, staged, time.perf_counter(), shared_positions)
        self.scheduler.decode_launched()
        table = self.scheduler.rows
        return _StepInFlight(rows, [table[row] for row in rows.tolist()], drawn, forward), bool(preempted or failed)

    def _held(self, step: _StepInFlight) -> np.ndarray:
        """Per row of ``step`` (bool): whether it still holds the request it held at the step's launch (the others
        finished at the step before it: their token from ``step`` is not theirs to keep)."""
        table = self.scheduler.rows
        return np.array([table[row] is req for row, req in zip(step.rows.tolist(), step.requests)], dtype=bool)

    @profiled("engine.accept")
    def _accept_in_flight(self, held: np.ndarray) -> None:
        """Waits for the step in flight's tokens and accepts those of its rows that still hold its requests
        (``held``, from :meth:`_held`)."""
        step, self._in_flight = self._in_flight, None
        started = time.perf_counter()
        tokens, logprobs = step.drawn.result()
        received = time.perf_counter()
        self._accept(step.rows[held], tokens[held], logprobs[held])
        self.recorder.decode_accepted(started, received, step.forward)

    def _accept_prefilled(self) -> None:
        """Waits for this round's prefilled first tokens and accepts those of its rows that still hold their
        requests (a row preempted since lost its token)."""
        prefill, self._prefilled = self._prefilled, None
        started = time.perf_counter()
        held = self._held(prefill)
        self._accept(prefill.rows[held], *(values[held] for values in prefill.drawn.result()))
        self.recorder.prefill_accepted(started, prefill.forward, prefill.copied)

    def _draw(self, rows: np.ndarray, logits: torch.Tensor, pending: np.ndarray | None = None) -> DrawnTokens:
        """Launches the sampling of the next token of the requests in cache rows ``rows`` from ``logits: [len(rows),
        V]`` in one batch (``pending`` as in :meth:`RunningRows.uniforms`)."""
        running = self._running
        return draw_rows(logits, running.temperature[rows], running.top_p[rows], running.uniforms(rows, pending))

    def _accept(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Appends ``tokens`` (log-probs ``logprobs``) to the requests in cache rows ``rows`` and retires those that
        finished (the scheduler frees their rows, keeping their K/V as a history with ``reuse_decode_kv``)."""
        finished, stopped = self._running.accept(rows, tokens, logprobs)
        retiring = time.perf_counter()
        for row, stop in zip(finished.tolist(), stopped.tolist()):
            req = self.scheduler.rows[row]
            req.output, req.logprobs = self._running.output(row)
            self.scheduler.finish(req)
            self._stop_row(row)
            self.recorder.request_finished(req.adapter, req.admitted - req.submitted)
            if not req.future.cancelled():
                req.future.set_result(Completion(req.output, req.logprobs, "stop" if stop else "length", req.version))
        self.recorder.tokens_accepted(len(tokens), retiring)

    def _free_row(self, row: int) -> None:
        """Frees cache row ``row`` (its blocks back to the pool) and stops it."""
        self.scheduler.release(row)
        self._stop_row(row)

    def _stop_row(self, row: int) -> None:
        """Row ``row`` (freed by the scheduler) runs no more."""
        if self._shared_rows is not None:
            self._shared_rows.clear(row)
        self._running.release(row)
