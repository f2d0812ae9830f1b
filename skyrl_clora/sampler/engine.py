"""The embedded multi-LoRA sampling engine: continuous batching across tenants over one base model.

One background thread owns the model. Each iteration of its loop:
  1. takes new requests and adapter publishes from the inbox;
  2. applies every pending publish whose adapter has no running request (the version fence: a request
     is sampled entirely with the adapter version it was admitted under; new requests of an adapter with
     a pending publish wait until it lands, so a publish cannot starve);
  3. admits waiting requests into free cache rows (FIFO over all tenants, while the KV block pool has room)
     and prefills them together (ragged passes, replayed from CUDA graphs on the GPU), each row starting with
     the keyed prompt blocks of its adapter version it can share (and, with ``reuse_decode_kv``, a finished
     turn's whole history when the prompt extends it: the next turn of a multi-turn episode then computes only
     its new tokens), by reference: :class:`BlockManager`;
  4. launches one decode step for the rows up to the last running one (a CUDA-graph replay on the GPU)
     and its sampling of every running row at once (each with its own counter-based RNG, see
     ``sampling``), then accepts the tokens of the step launched before it and the first tokens of the
     rows prefilled in step 3, and retires the finished requests, resolving their futures. The host thus
     works on step t's tokens while the GPU runs step t+1, whose rows of step t (and rows just prefilled)
     take their input tokens from the device; a prefill never waits for the decode step ahead of it. A row
     whose step-t token ends it (a stop token, or its length limit while other rows go on) runs once more
     at t+1, and that token is dropped.
Which publishes land and which waiting requests take which rows in steps 2 and 3 is the :class:`Scheduler`'s
decision (``scheduler``, which holds the row table); the engine applies and prefills what it decides.
Rows take KV blocks as they grow. When a running row needs a block and the pool has none (after evicting
unreferenced prefix blocks and histories), the most recently admitted running request is preempted: its
blocks go back to the pool and it waits first in the queue, to start over (its tokens are drawn again from
the same counter-based RNG); a request that cannot fit even alone fails with a MemoryError.
Other tenants' requests keep decoding while one tenant's adapter is published: a publish is a ``copy_``
into that tenant's slot between two decode steps (dropping only that tenant's cached prefixes), never a
pause or a global cache reset.
On a GPU the engine thread issues its work on a CUDA stream of its own, so it can overlap with training
(``trainer.overlap_sampling=true``; by default on a GPU the train scheduler pauses the engine for each pass),
at high priority by default, so it goes ahead of it (``stream_priority``).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import numpy as np
import torch

from skyrl_clora.device_copy import lists_to_device
from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear
from skyrl_clora.sampler.adapter_slots import AdapterSlots
from skyrl_clora.sampler.block_manager import BlockManager
from skyrl_clora.profiling import profiled
from skyrl_clora.sampler.engine_stats import EngineStats, GPUSpan, GPUTimeline
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.model_runner import DECODE_ROW_QUANTUM, ModelRunner, PrefillJob
from skyrl_clora.sampler.requests import Completion, SamplingParams
from skyrl_clora.sampler.running_rows import RunningRows
from skyrl_clora.sampler.sampling import DrawnTokens, draw_rows
from skyrl_clora.sampler.scheduler import Publish, QueuedRequest, Scheduler, Unregister
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


class Engine(EngineThread):
    """Multi-tenant sampler (see module docstring), its rounds run by its own thread (:class:`EngineThread`). Thread-safe: ``submit`` and ``publish`` may be called
    from any thread and return ``concurrent.futures.Future`` objects.

    ``num_blocks``: KV blocks of ``block_size`` positions in the pool (None: enough for every row at
    ``max_len`` twice over: a CPU default; a GPU's comes from the memory plan). ``cache_prefixes``: prompt
    blocks stay keyed for later prompts with the same prefix (and histories may be kept).

    ``reuse_decode_kv``: a finished request's blocks (its prompt and sampled tokens) stay in the pool as a
    history, which the next request whose prompt extends it adopts instead of recomputing. Decode
    steps compute K/V with other kernels than prefill, so on the CPU this would make a request's bits
    depend on whether its history was still cached (i.e. on other tenants' traffic): off by default,
    on for GPU runs (``sampler.reuse_decode_kv``).

    ``share_prefix_reads``: decode attention reads the positions of the keyed blocks that rows share once for
    up to eight such rows (:class:`SharedPrefixRows`), instead of once per row: the same answer up to
    rounding (bit for bit on the CPU, whose reference reads the shared blocks per row). On for
    GPU runs (the services), where decode attention is bound by reading K/V.

    ``stream_priority``: ``"high"`` (the engine's blocks are scheduled ahead of waiting training blocks) or
    ``"normal"`` (the engine's stream and the trainer's default stream share the GPU as equals).

    ``prefill_wait_steps``: while rows decode, a waiting request is prefilled once ``max_prefills_per_step``
    requests wait or it has waited this many decode steps (:class:`Scheduler`); 0 prefills at every round.

    ``kv_dtype``: the KV cache's dtype (None: the model's; ``torch.float8_e4m3fn``: half the bytes per block and
    per decode read, scale 1.0, see :class:`ModelRunner`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        lora_layers: dict[str, MultiLoRALinear],
        num_rows: int,
        max_len: int,
        max_prefills_per_step: int = 8,
        block_size: int = 16,
        num_blocks: int | None = None,
        cache_prefixes: bool = True,
        cuda_graphs: bool = True,
        reuse_decode_kv: bool = False,
        share_prefix_reads: bool = False,
        stream_priority: str = "high",
        prefill_wait_steps: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        max_len = -(-max_len // block_size) * block_size  # whole prefill blocks
        num_rows = -(-num_rows // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM
        num_blocks = num_blocks or 2 * num_rows * (max_len // block_size)
        self.runner = ModelRunner(model, num_rows=num_rows, max_len=max_len, block_size=block_size,
                                  prefill_tokens=max_prefills_per_step * block_size, num_blocks=num_blocks,
                                  share_prefix_reads=share_prefix_reads, kv_dtype=kv_dtype)
        self._shared_rows = SharedPrefixRows(num_rows) if share_prefix_reads else None
        self.blocks = BlockManager(num_blocks, block_size, num_rows, max_len // block_size, cache_prefixes)
        self.reuse_decode_kv = reuse_decode_kv and cache_prefixes
        self.lora_layers = lora_layers
        self.adapters = AdapterSlots(lora_layers)
        self.max_len = max_len
        self.max_prefills_per_step = max_prefills_per_step
        self.stats = EngineStats()
        self.gpu_timeline: GPUTimeline | None = None  # see record_gpu_intervals
        if cuda_graphs and self.runner.device.type == "cuda":
            self.stats.graph_capture_seconds = self.runner.capture_graphs()
        self.scheduler = Scheduler(num_rows, self.adapters, self.blocks, max_prefills_per_step,
                                   self.reuse_decode_kv, prefill_wait_steps)
        self._admitted_at = np.zeros(num_rows, dtype=np.int64)  # per row: when its request was admitted
        self._admissions = 0
        self._running = RunningRows(num_rows, max_len)  # per cache row: decode inputs, settings, outputs so far
        self._in_flight: _StepInFlight | None = None  # the decode step launched last
        self._prefilled: _StepInFlight | None = None  # this round's prefill, its first tokens not accepted yet
        self.start_thread(self.runner.device, stream_priority)

    # ---- public API (any thread) -------------------------------------------------------------

    def register_adapter(self, name: str, weights: AdapterWeights, version: int = 0) -> None:
        """Gives ``name`` a LoRA slot holding ``weights`` (before any request of it is submitted)."""
        self.adapters.reserve(name)
        self.publish(name, weights, version).result()

    def unregister_adapter(self, name: str) -> concurrent.futures.Future:
        """Frees ``name``'s slot once none of its requests is running; its waiting requests fail.
        Resolves when the slot is free."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if name not in self.adapters:
            future.set_exception(ValueError(f"unknown adapter {name!r}"))
            return future
        self._inbox.put(Unregister(name, future))
        return future

    def adapter_version(self, name: str) -> int:
        """The published version of ``name`` (``AdapterSlots.version``)."""
        return self.adapters.version(name)

    def submit(self, prompt_ids: list[int], adapter: str | None, params: SamplingParams) -> concurrent.futures.Future:
        """Queues one generation request; the future resolves to a :class:`Completion`."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if adapter is not None and adapter not in self.adapters:
            future.set_exception(ValueError(f"unknown adapter {adapter!r}; registered: {self.adapters.names()}"))
            return future
        if not prompt_ids or len(prompt_ids) >= self.max_len:
            future.set_exception(
                ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the engine's max_len {self.max_len}")
            )
            return future
        self._inbox.put(QueuedRequest(list(prompt_ids), adapter, params, future))
        return future

    def publish(self, adapter: str, weights: AdapterWeights, version: int) -> concurrent.futures.Future:
        """Queues an in-place update of ``adapter``'s slot to ``weights`` at ``version``; resolves once applied."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if adapter not in self.adapters:
            future.set_exception(ValueError(f"unknown adapter {adapter!r}"))
            return future
        self._inbox.put(Publish(adapter, weights, version, future))
        return future

    def running_rows(self) -> int:
        """How many requests hold a row now (read from any thread: a snapshot)."""
        return int(np.count_nonzero(self._running.active))

    # ---- engine thread -----------------------------------------------------------------------

    def _enqueue(self, item: QueuedRequest | Publish | Unregister) -> None:
        self.scheduler.enqueue(item)

    def _idle(self) -> bool:
        return self.scheduler.idle()

    def _has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def _finish_step_in_flight(self) -> None:
        self._accept_in_flight(self._held(self._in_flight))

    def _fail_steps(self, error: Exception) -> None:
        self._in_flight = self._prefilled = None
        self._fail_running(error)

    def step(self) -> None:
        """One round of the engine thread's work: applies the publishes that may land, admits and prefills waiting
        requests, launches the next decode step and accepts the one before. Runs on the engine thread, or on the
        caller's once :meth:`shutdown` has stopped it (a benchmark driving the steps itself)."""
        self._apply_publishes()
        self._admit()
        self._decode()

    def start_row(self, request: QueuedRequest) -> None:
        """Makes ``request`` run in its cache row ``request.row`` (whose blocks hold the K/V of its prompt), its
        first token not drawn yet. Same threads as :meth:`step`."""
        if self._shared_rows is not None:
            self._shared_rows.assign(request.row, self.blocks.identity(request.row))
        self.scheduler.place(request)
        self._admissions += 1
        self._admitted_at[request.row] = self._admissions
        params = request.params
        self._running.start(request.row, len(request.prompt_ids), request.lora_slot, params.seed, params.temperature,
                            params.top_p, params.max_tokens, params.stop_token_ids)
        self.stats.peak_running_rows = max(self.stats.peak_running_rows, self.running_rows())

    def _apply_publishes(self) -> None:
        """Applies the publishes and unregisters the scheduler lets land now (:meth:`Scheduler.ready_publishes`),
        each dropping its adapter's cached prefixes; a failed one fails its own future."""
        for publish in self.scheduler.ready_publishes():
            try:
                self.blocks.drop_adapter(publish.adapter)
                if isinstance(publish, Unregister):
                    self.adapters.clear(publish.adapter)
                    self.scheduler.fail_waiting(publish.adapter)
                else:
                    self.adapters.write(publish.adapter, publish.weights, publish.version)
                publish.future.set_result(None)
            except Exception as error:
                publish.future.set_exception(error)

    @profiled("engine.admit")
    def _admit(self) -> None:
        """Prefills the requests :meth:`Scheduler.admit` admits in this round in one batched call; a failed
        prefill fails its own requests, not the running ones."""
        admitted = self.scheduler.admit()
        if not admitted:
            return
        try:
            self._prefill(admitted)
        except Exception as error:  # a failed prefill fails its own requests, not the running ones
            for req in admitted:
                if req.row < 0:  # queued again for want of blocks: it waits, unharmed
                    continue
                if self.scheduler.rows[req.row] is req:
                    self._retire_row(req.row)
                else:
                    self.blocks.release(req.row)
                if not req.future.done():
                    req.future.set_exception(error)

    @profiled("engine.prefill")
    def _prefill(self, requests: list[QueuedRequest]) -> None:
        """Prefills ``requests`` (rows and adapter versions set by :meth:`Scheduler.admit`), starts their rows
        (:meth:`start_row`) and samples their first tokens. Each row first adopts its history's blocks or the
        keyed blocks of its prompt, copies the one it must write into if shared, and takes blocks for the rest;
        a request the pool cannot take now goes back to the queue."""
        started = time.perf_counter()
        block = self.runner.block_size
        ready, starts, short = [], [], []
        copies: tuple[list[int], list[int]] = ([], [])
        for req in requests:
            req.lora_slot = -1 if req.adapter is None else self.adapters.slot(req.adapter)
            try:
                starts.append(self._take_blocks(req, copies))
                ready.append(req)
            except MemoryError:
                self.blocks.release(req.row)
                short.append(req)
        for req in reversed(short):  # they wait first in the queue, in their order
            self.scheduler.requeue(req)
        if not ready:
            return
        prompts = lists_to_device([req.prompt_ids for req in ready], self.runner.device)
        jobs = [PrefillJob(req.row, tokens, req.lora_slot, start=start) for req, tokens, start in zip(ready, prompts, starts)]
        with GPUSpan(self.runner.device) as copied:  # copies of shared blocks a row writes into
            if copies[0]:
                self.runner.copy_blocks(*copies)
            self._sync_tables()
        with GPUSpan(self.runner.device) as forward:
            logits = torch.stack(self.runner.prefill(jobs))
        self.stats.prefill_rounds += 1
        for req, job in zip(ready, jobs):
            if req.history is None:  # a history's positions were partly computed by decode steps: not keyed
                self.blocks.key_prompt(req.row, req.adapter, req.version, req.prompt_ids, job.start // block)
            req.history = None
            self.stats.prefill_tokens += len(req.prompt_ids) - job.start
            self.stats.cached_prompt_tokens += job.start
            self.start_row(req)
        self.stats.peak_blocks_held = max(self.stats.peak_blocks_held, self.blocks.held_blocks())
        rows = np.array([req.row for req in ready], dtype=np.int64)
        drawn = self._draw(rows, logits)
        self.runner.record_sampled(lists_to_device([rows], logits.device)[0], drawn.tokens)
        self._prefilled = _StepInFlight(rows, ready, drawn, forward, copied)
        self.stats.prefill_seconds += time.perf_counter() - started

    def _take_blocks(self, req: QueuedRequest, copies: tuple[list[int], list[int]]) -> int:
        """Gives ``req``'s row the blocks of its prompt: its history's, or the keyed ones of its leading whole
        blocks, then a copy of the block it writes into first if that one is shared (appended to ``copies`` as
        source and target), then new blocks for the rest. Returns the first position the prefill computes (the
        last prompt token always: its logits are needed). Raises MemoryError when the pool is short."""
        block = self.runner.block_size
        if req.history is not None:
            length, held = req.history
            self.blocks.adopt(req.row, held, owned=True)
            start = min(length, len(req.prompt_ids) - 1)
        else:
            cached = self.blocks.lookup(req.adapter, req.version, req.prompt_ids)
            self.blocks.adopt(req.row, cached, owned=False)
            start = min(len(cached) * block, len(req.prompt_ids) - 1)
        if start < self.blocks.row_counts[req.row] * block:
            copy = self.blocks.make_writable(req.row, start // block)
            if copy is not None:
                copies[0].append(copy[0])
                copies[1].append(copy[1])
        if not self.blocks.grow(req.row, -(-len(req.prompt_ids) // block)):
            raise MemoryError(f"no KV block is free for a prompt of {len(req.prompt_ids)} tokens")
        return start

    def _sync_tables(self) -> None:
        """Copies the block tables to the device if they changed (ordered after the work queued before)."""
        if self.blocks.dirty:
            self.runner.set_block_tables(self.blocks.tables)
            self.blocks.dirty = False

    def _decode(self) -> None:
        """Launches the next decode step (if a row runs), then accepts the step in flight before it and this
        round's prefilled first tokens. Which rows of the step in flight still hold its requests is found once:
        nothing admits or retires in between (a row retired at the last accept and admitted again holds a new
        request, whose token in flight is the prefill's)."""
        step, prefilled = self._in_flight, self._prefilled
        pending = np.zeros(self.runner.num_rows, dtype=bool)  # rows whose token in flight is to come
        held = None if step is None else self._held(step)
        if step is not None:
            pending[step.rows[held]] = True
        if prefilled is not None:
            pending[prefilled.rows] = True
        preemptions = self.stats.preemptions
        launched = self._launch_decode(pending) if any(self.scheduler.rows) else None
        if step is not None:
            if self.stats.preemptions != preemptions:  # a preempted row's token in flight is not its own any more
                held &= self._held(step)
            self._accept_in_flight(held)
        if prefilled is not None:
            self._accept_prefilled()
        self._in_flight = launched

    @profiled("engine.decode_step")
    def _launch_decode(self, pending: np.ndarray) -> _StepInFlight | None:
        """Launches a decode step and its sampling for the rows up to the last running one, rounded up to whole
        row quanta (requests take the lowest free rows, so the running ones stay packed at the front), without
        waiting for the GPU. The ``pending`` rows (``[num_rows]`` bool: those of the step in flight that still
        hold its requests) take their input tokens from its draw on the device. Returns None, launching
        nothing, when every running row's token in flight is certain to be its last."""
        started = time.perf_counter()
        running = self._running
        if not (running.active & ~running.ending(pending)).any():
            return None
        self._grow_rows(pending)
        rows = running.active_below(self.runner.num_rows)
        if not rows.size:  # every running request was preempted or failed
            return None
        self._sync_tables()
        span = min(self.runner.num_rows, -(-(int(rows[-1]) + 1) // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM)
        prefix_rows = prefix_lens = None
        if self._shared_rows is not None:
            prefix_rows, prefix_lens = self._shared_rows.sources(span)  # rows past the span hold no identity
            self.stats.shared_prefix_positions += self._shared_rows.borrowed_positions
        self.runner.set_decode_inputs(*running.decode_inputs(span, pending), prefix_rows, prefix_lens,
                                      from_sampled=pending[:span])
        staged = time.perf_counter()
        with GPUSpan(self.runner.device) as forward:
            logits = self.runner.decode(span)
        rows_device = lists_to_device([rows], logits.device)[0]
        drawn = self._draw(rows, logits.index_select(0, rows_device), pending)
        self.runner.record_sampled(rows_device, drawn.tokens)
        launched = time.perf_counter()
        self.stats.decode_input_seconds += staged - started
        self.stats.decode_launch_seconds += launched - staged
        self.stats.decode_steps += 1
        self.scheduler.decode_launched()
        self.stats.decode_seconds += launched - started
        table = self.scheduler.rows
        return _StepInFlight(rows, [table[row] for row in rows.tolist()], drawn, forward)

    def _grow_rows(self, pending: np.ndarray) -> None:
        """Gives every running row the block its next decode step writes into (position ``prompt_len + drawn -
        1``, one further for a ``pending`` row), preempting the most recently admitted running request while
        the pool has none (:meth:`_preempt`); a request that is alone and still short fails."""
        running = self._running
        rows = running.active_below(self.runner.num_rows)
        positions = running.prompt_len[rows] + running.drawn[rows] + pending[rows] - 1
        needed = positions // self.blocks.block_size + 1
        short = needed > self.blocks.row_counts[rows]
        for row, count in zip(rows[short].tolist(), needed[short].tolist()):
            while running.active[row] and not self.blocks.grow(row, count):
                running_rows = running.active_below(self.runner.num_rows)
                victim = int(running_rows[np.argmax(self._admitted_at[running_rows])])
                if running_rows.size == 1:
                    req = self.scheduler.rows[row]
                    self._retire_row(row)
                    req.future.set_exception(MemoryError(
                        f"a request of {int(running.prompt_len[row])} prompt tokens needs more than the {self.blocks.num_blocks} "
                        f"KV blocks of {self.blocks.block_size} tokens the pool holds: raise sampler.gpu_memory_utilization "
                        "(or sampler.kv_blocks) or lower its max_tokens"))
                else:
                    self._preempt(victim)

    def _preempt(self, row: int) -> None:
        """Stops the request in ``row`` and queues it first, to start over (its blocks go back to the pool)."""
        req = self.scheduler.rows[row]
        self._retire_row(row)
        req.output, req.logprobs = [], []
        self.scheduler.requeue(req)
        self.stats.preemptions += 1

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
        self.stats.decode_wait_seconds += received - started
        self.stats.decode_gpu_seconds += step.forward.seconds()
        self._on_timeline(step.forward)
        self.stats.decode_seconds += time.perf_counter() - started

    def record_gpu_intervals(self) -> GPUTimeline:
        """From now on, the GPU interval of every decode step's forward pass and prefill round's copies and forward
        pass, on the host clock, in the returned timeline (CUDA only)."""
        self.gpu_timeline = GPUTimeline(self.runner.device)
        return self.gpu_timeline

    def _on_timeline(self, *spans: GPUSpan) -> None:
        if self.gpu_timeline is not None:
            for span in spans:
                self.gpu_timeline.add(span)

    def _accept_prefilled(self) -> None:
        """Waits for this round's prefilled first tokens and accepts those of its rows that still hold their
        requests (a row preempted since lost its token)."""
        prefill, self._prefilled = self._prefilled, None
        started = time.perf_counter()
        held = self._held(prefill)
        self._accept(prefill.rows[held], *(values[held] for values in prefill.drawn.result()))
        self.stats.prefill_gpu_seconds += prefill.forward.seconds()
        self.stats.prefill_copy_gpu_seconds += prefill.copied.seconds()
        self._on_timeline(prefill.copied, prefill.forward)
        self.stats.prefill_seconds += time.perf_counter() - started

    def _draw(self, rows: np.ndarray, logits: torch.Tensor, pending: np.ndarray | None = None) -> DrawnTokens:
        """Launches the sampling of the next token of the requests in cache rows ``rows`` from ``logits: [len(rows),
        V]`` in one batch (``pending`` as in :meth:`RunningRows.uniforms`)."""
        running = self._running
        return draw_rows(logits, running.temperature[rows], running.top_p[rows], running.uniforms(rows, pending))

    def _accept(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Appends ``tokens`` (log-probs ``logprobs``) to the requests in cache rows ``rows`` and retires those that
        finished."""
        self.stats.generated_tokens += len(tokens)
        finished, stopped = self._running.accept(rows, tokens, logprobs)
        retiring = time.perf_counter()
        for row, stop in zip(finished.tolist(), stopped.tolist()):
            req = self.scheduler.rows[row]
            req.output, req.logprobs = self._running.output(row)
            self._retire(req, "stop" if stop else "length")
        self.stats.retire_seconds += time.perf_counter() - retiring

    def _retire(self, req: QueuedRequest, reason: str) -> None:
        if self.reuse_decode_kv:  # the row holds the K/V of the prompt and of every sampled token but the last
            self.blocks.keep_history(req.row, req.adapter, req.version, req.prompt_ids + req.output[:-1])
        self._retire_row(req.row)
        if not req.future.cancelled():
            req.future.set_result(Completion(req.output, req.logprobs, reason, req.version))

    def _retire_row(self, row: int) -> None:
        if self._shared_rows is not None:
            self._shared_rows.clear(row)
        self.blocks.release(row)
        self.scheduler.release(row)
        self._running.release(row)

    def _fail_running(self, error: Exception) -> None:
        for req in self.scheduler.running():
            self._retire_row(req.row)
            if not req.future.done():
                req.future.set_exception(error)
