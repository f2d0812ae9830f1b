"""Runs a Hugging Face decoder (Qwen3 / Qwen2 / Llama module layout) over a paged KV cache.

The HF modules supply the weights (embeddings, norms, projections with multi-LoRA, MLP) and the rotary
tables; this runner replaces the attention bookkeeping, so that many sequences of different lengths decode
together, runs each layer's projections as four groups (q/k/v, o, gate/up, down) of one GEMM, whose weight
holds the slots' LoRA A, and one LoRA expand each (``fused_projections``; q/k/v's expand runs inside the q/k
norm + rotary kernel, which also stores k and v into the cache: ``kernels.folded_qkv_rope_into_cache``), and
runs the element-wise parts of each layer through the kernels' fused ops (RMSNorm with the residual add,
SiLU-mul: one Triton launch each on the GPU; on the CPU their references, which are Hugging Face's own ops in
order):

- ``prefill(jobs)``: several prompts written into their cache rows by ragged forward passes of at most
  ``prefill_tokens`` positions (the prompts' positions laid end to end, no per-prompt padding), from any
  start position (the positions before it already hold the prompt's K/V: cached blocks or a finished
  turn's history); returns each prompt's last-token logits ``[V]``.
- ``decode(span)``: one token for each of the batch positions ``0..span-1`` from the runner's decode input
  buffers (``set_decode_inputs``: each position's cache row, token, position and slot; the engine packs the
  running rows at the front, whichever cache rows they hold); each attends to its cache row up to its position
  (with ``share_prefix_reads``, its first positions through the batch position the engine names as holding the
  same K/V). On CUDA the
  step is replayed from a CUDA graph captured per span bucket (``capture_graphs``): the inputs,
  the LoRA slot buffers and the segment metadata live in fixed buffers, so in-place adapter publishes and
  new inputs are seen by the replay.

KV cache: ``k_cache, v_cache: [layers, num_blocks + 1, kv_heads, block_size, head_dim]`` in the model dtype or
``kv_dtype`` (``torch.float8_e4m3fn``: k and v stored with a scale of 1.0, converted back to the model dtype as the
attention kernels read them; values beyond +-448 are out of e4m3's range, as in vLLM's ``kv_cache_dtype=fp8``),
blocks of ``block_size`` positions; cache row ``r``'s position ``p`` lives in block ``block_tables[r, p //
block_size]`` at offset ``p % block_size`` (``block_tables: [num_rows + 1, max_len // block_size]`` int32 on the
device, written by :meth:`set_block_tables` from the engine's :class:`BlockManager`; a runner built without
``num_blocks`` gives each row a run of blocks of its own). The last block is scratch
space: free rows' table entries name it, and the last table row (the scratch row, every entry the scratch
block) takes a prefill pass's padding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from skyrl_clora.device.staging import lists_to_device
from skyrl_clora.kernels import (
    FP8_CACHE_DTYPE,
    DecodeWorkspace,
    KVCacheWrite,
    LoRAMeta,
    decode_attention,
    folded_qkv_rope_into_cache,
    prefill_attention,
    rms_norm,
    silu_mul,
)
from skyrl_clora.device.profiling import profiled
from skyrl_clora.sampler.fused_projections import fused_layer_projections

DECODE_ROW_QUANTUM = 16  # decode batches are whole multiples of this many cache rows
PREFILL_TOKEN_QUANTUM = 16  # a prefill pass's flat batch is padded to whole multiples of this many positions


def decode_buckets(num_rows: int) -> list[int]:
    """Spans a CUDA graph is captured for: multiples of 16 up to 64, then of 64 (every span rounds up to one)."""
    buckets = [span for span in (16, 32, 48, 64) if span < num_rows]
    buckets += list(range(128, num_rows, 64))
    return buckets + [num_rows]


def prefill_buckets(prefill_tokens: int) -> list[int]:
    """Flat-batch sizes a prefill pass's CUDA graph is captured for: 16, 32, ... doubling up to 512, then
    multiples of 256, and ``prefill_tokens`` (every pass rounds up to one)."""
    buckets = [size for size in (16, 32, 64, 128, 256, 512) if size < prefill_tokens]
    buckets += list(range(768, prefill_tokens, 256))
    return buckets + [prefill_tokens]


@dataclass
class PrefillJob:
    """One prompt to prefill: ``tokens: [T]`` into cache row ``row`` from position ``start`` on."""

    row: int
    tokens: torch.Tensor
    lora_slot: int
    start: int = 0


class ModelRunner:
    """Forward passes of a causal LM over a slot-based KV cache (see module docstring)."""

    def __init__(self, model: nn.Module, num_rows: int, max_len: int, block_size: int,
                 prefill_tokens: int, num_blocks: int | None = None, share_prefix_reads: bool = False,
                 kv_dtype: torch.dtype | None = None) -> None:
        if max_len % block_size:
            raise ValueError(f"max_len {max_len} must be a multiple of the prefill block size {block_size}")
        if num_rows % DECODE_ROW_QUANTUM:
            raise ValueError(f"num_rows {num_rows} must be a multiple of {DECODE_ROW_QUANTUM}")
        self.model = model.eval()
        self.decoder = model.model
        config = model.config
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"the embedded engine runs SwiGLU MLPs (hidden_act=silu); this model has {config.hidden_act}")
        if model.lm_head.bias is not None:
            raise ValueError("the embedded engine runs LM heads without a bias")
        self.num_rows = num_rows
        self.max_len = max_len
        self.block_size = block_size
        if prefill_tokens < block_size or prefill_tokens % block_size:
            raise ValueError(f"prefill_tokens {prefill_tokens} must be a positive multiple of the block size {block_size}")
        self.prefill_tokens = prefill_tokens  # positions one prefill pass computes at most
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.scratch_row = num_rows  # a cache row no request uses: a prefill pass's padding writes its K/V there
        # Without a pool size, each row owns max_len // block_size blocks of its own (row r: the r-th run).
        per_row = max_len // block_size
        contiguous = num_blocks is None
        self.num_blocks = num_blocks = num_rows * per_row if contiguous else num_blocks
        shape = (len(self.decoder.layers), num_blocks + 1, self.num_kv_heads, block_size, self.head_dim)
        self.kv_dtype = kv_dtype or self.dtype
        if self.kv_dtype not in (self.dtype, FP8_CACHE_DTYPE):
            raise ValueError(f"kv_dtype {self.kv_dtype} is neither the model's {self.dtype} nor {FP8_CACHE_DTYPE}")
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
        self.block_tables = torch.full((num_rows + 1, per_row), num_blocks, dtype=torch.int32, device=self.device)
        if contiguous:
            self.block_tables[:num_rows] = torch.arange(num_blocks, dtype=torch.int32, device=self.device).view(num_rows, per_row)
        # Decode inputs (written by set_decode_inputs, read by eager steps and graph replays): per batch position,
        # its cache row (the step reads and writes K/V through that row's block table, gathered into
        # ``_decode_tables`` by the step itself), token, position and LoRA slot.
        self.decode_rows = torch.arange(num_rows, device=self.device)
        self._batch_index = torch.arange(num_rows, device=self.device)
        self._decode_tables = self.block_tables[:num_rows].clone()
        self.decode_tokens = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        self.decode_positions = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        self.decode_slots = torch.full((num_rows,), -1, dtype=torch.long, device=self.device)
        # Per cache row (the scratch row included): the token the engine's last decode step that ran it drew on the
        # device (``record_sampled``), the next input of a row whose token the host has not read yet.
        self.sampled_tokens = torch.zeros(num_rows + 1, dtype=torch.long, device=self.device)
        # Per batch position: the batch position whose table holds its first ``decode_prefix_lens`` positions
        # (decode_attention's prefix_rows / prefix_lens), when share_prefix_reads.
        self.share_prefix_reads = share_prefix_reads
        self.decode_prefix_rows = torch.arange(num_rows, device=self.device)
        self.decode_prefix_lens = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        # Segment metadata of the multi-LoRA kernels, built once per forward into fixed buffers (CUDA only:
        # the CPU reference needs none).
        self.lora_meta: LoRAMeta | None = None
        lora_layer = next((m for m in model.modules() if hasattr(m, "lora_a")), None)
        if self.device.type == "cuda" and lora_layer is not None:
            num_slots, max_rank = lora_layer.lora_a.shape[0], lora_layer.lora_a.shape[1]
            tokens = max(num_rows, self.prefill_tokens)
            # workspace for the widest fused projection (q/k/v: three slices)
            self.lora_meta = LoRAMeta(tokens, num_slots, self.device, max_rank=max_rank, max_slices=3)
        self._attention_workspace: DecodeWorkspace | None = None
        if self.device.type == "cuda":
            self._attention_workspace = DecodeWorkspace(num_rows, self.num_heads, max_len,
                                                        self.head_dim, self.device)
        # Every decode step's logits land in rows ``0..span-1`` of one buffer, whatever the span or graph: one
        # output per captured graph would keep ``sum(buckets) x V`` elements alive (9.6 GiB at 2,048 rows, Qwen3's V).
        self._decode_logits = torch.empty(num_rows, model.lm_head.weight.shape[0], dtype=self.dtype, device=self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_capture_seconds = 0.0  # decode graphs and, as they are captured, prefill graphs
        # Inputs of a prefill pass (written by _prefill_pass, read by eager passes and graph replays): the
        # flat batch's token ids, its (positions, cache rows, LoRA slots) and its jobs' (cache rows, first
        # positions, first flat index, token counts); unused job slots count 0 tokens.
        self.max_prefill_jobs = prefill_tokens // block_size
        self._pass_ids = torch.zeros(prefill_tokens, dtype=torch.long, device=self.device)
        self._pass_tokens = torch.zeros(3, prefill_tokens, dtype=torch.long, device=self.device)
        self._pass_jobs = torch.zeros(4, self.max_prefill_jobs, dtype=torch.long, device=self.device)
        # With prefill_graphs (turned on by capture_graphs), prefill passes replay CUDA graphs by flat-batch
        # size, each captured on its first use.
        self.prefill_graphs = False
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every prefill pass's logits (fp32, one row per job slot) land in one buffer, whatever its graph.
        job_rows = -(-self.max_prefill_jobs // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM
        self._prefill_logits = torch.empty(job_rows, model.lm_head.weight.shape[0], dtype=torch.float32, device=self.device)
        self._prefill_pool = None
        # One capture stream for every prefill graph: the caching allocator reuses a pool's freed blocks only on
        # the stream that allocated them, so a stream per capture would keep every graph's intermediates.
        self._prefill_capture_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._projections = fused_layer_projections(self.decoder.layers)  # per layer: q/k/v, o, gate/up, down

    @torch.no_grad()
    @profiled("runner.prefill")
    def prefill(self, jobs: list[PrefillJob]) -> list[torch.Tensor]:
        """Prefills several prompts together; returns each one's last-token logits ``[V]`` (fp32).

        Job ``i`` fills cache row ``jobs[i].row`` at positions ``start..T-1`` from ``tokens: [T]`` (positions
        ``< start`` must already hold the prompt's K/V, e.g. copied from the prefix cache).

        A forward pass is ragged: a flat batch of at most ``prefill_tokens`` positions holding the next
        positions of up to ``prefill_tokens // block_size`` unfinished jobs, in job order, each job all its
        remaining positions while they fit and the pass's last job as many as fit (the rest waits for the
        next pass). No job is padded; the flat batch is padded at its end to whole :data:`PREFILL_TOKEN_QUANTUM`
        positions, whose K/V go to a scratch cache row. Attention (``kernels.attention.prefill``) reads each
        job's keys straight from its cache row. A token's K/V depend only on the tokens up to it: on the CPU
        (one thread) bit for bit whatever the pass looks like, so a cached block equals a recomputed one;
        on the GPU up to the last bits of kernels that pick their reduction order by shape. ``start`` may be
        any position below ``T`` (a multiple of ``block_size`` when the positions before it come from the
        prefix cache, any when they are a finished turn's history).
        """
        for job in jobs:
            if not 0 <= job.start < job.tokens.shape[0]:
                raise ValueError(f"prefill start {job.start} must be below the prompt length {job.tokens.shape[0]}")
        logits: list[torch.Tensor | None] = [None] * len(jobs)
        offsets = [job.start for job in jobs]
        while True:
            picked: list[tuple[int, int]] = []  # (job index, positions this pass computes)
            budget = self.prefill_tokens
            for i, job in enumerate(jobs):
                left = job.tokens.shape[0] - offsets[i]
                if left <= 0:
                    continue
                if len(picked) == self.max_prefill_jobs or budget == 0:
                    break
                picked.append((i, min(left, budget)))
                budget -= picked[-1][1]
            if not picked:
                return logits
            pass_logits = self._prefill_pass([(jobs[i], offsets[i], count) for i, count in picked])
            for (i, count), row_logits in zip(picked, pass_logits):
                offsets[i] += count
                if offsets[i] == jobs[i].tokens.shape[0]:
                    logits[i] = row_logits

    def _prefill_pass(self, chunks: list[tuple[PrefillJob, int, int]]) -> torch.Tensor:
        """One ragged forward pass over ``chunks`` of ``(job, first position, count)``: writes their K/V and
        returns the logits ``[len(chunks), V]`` (fp32) of each chunk's last position. With
        :attr:`prefill_graphs` (set by :meth:`capture_graphs`), a pass replays the graph of its flat-batch
        size (:func:`prefill_buckets`), captured on that size's first use (right after an eager pass, which
        compiles the kernels)."""
        total = sum(count for _, _, count in chunks)
        size = min(-(-total // PREFILL_TOKEN_QUANTUM) * PREFILL_TOKEN_QUANTUM, self.prefill_tokens)
        if self.prefill_graphs:
            size = next(bucket for bucket in prefill_buckets(self.prefill_tokens) if bucket >= total)
        self._pass_ids[:total].copy_(torch.cat([job.tokens[start : start + count] for job, start, count in chunks]))
        positions: list[int] = []
        token_rows: list[int] = []
        token_slots: list[int] = []
        offsets: list[int] = []
        for job, start, count in chunks:
            offsets.append(len(positions))
            positions.extend(range(start, start + count))
            token_rows.extend([job.row] * count)
            token_slots.extend([job.lora_slot] * count)
        pad = size - total  # the padding's K/V go to the scratch row; its ids are whatever the buffer holds
        unused = [0] * (self.max_prefill_jobs - len(chunks))
        tokens, jobs = lists_to_device(
            [positions + [0] * pad + token_rows + [self.scratch_row] * pad + token_slots + [-1] * pad,
             [job.row for job, _, _ in chunks] + unused + [start for _, start, _ in chunks] + unused
             + offsets + unused + [count for _, _, count in chunks] + unused], self.device)
        self._pass_tokens[:, :size].copy_(tokens.view(3, size))
        self._pass_jobs.copy_(jobs.view(4, -1))
        if not self.prefill_graphs:
            return self._prefill_forward(size)[: len(chunks)].clone()  # the buffer is overwritten by the next pass
        if size not in self._prefill_graphs:
            logits = self._prefill_forward(size)[: len(chunks)].clone()
            self._capture_prefill(size)
            return logits
        self._prefill_graphs[size].replay()
        return self._prefill_logits[: len(chunks)].clone()

    def _prefill_forward(self, size: int) -> torch.Tensor:
        """The prefill pass over the first ``size`` positions of the pass buffers -> logits ``[J', V]`` (fp32,
        a view of the pass logits buffer) of each job slot's last position (``J'``: the job slots rounded up to
        whole row quanta, so that a row gets the same bits whatever the pass holds)."""
        ids = self._pass_ids[:size]
        positions, token_rows, token_slots = self._pass_tokens[:, :size]
        job_rows, job_starts, q_offsets, q_lens = self._pass_jobs
        scale = 1 / math.sqrt(self.head_dim)  # exactly SDPA's default

        def attend(layer_idx: int, q: torch.Tensor) -> torch.Tensor:
            # q: [T, H, d]; each job attends to its own cache row.
            return prefill_attention(q, self.k_cache[layer_idx], self.v_cache[layer_idx], job_rows, job_starts, q_offsets,
                                     q_lens, scale, block_tables=self.block_tables)

        hidden = self._forward(ids, positions, token_slots, self.block_tables, token_rows, attend)
        last = hidden.index_select(0, (q_offsets + q_lens - 1).clamp(min=0))  # [J, hidden]
        rows = -(-last.shape[0] // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM
        last = torch.cat([last, last.new_zeros(rows - last.shape[0], last.shape[1])])
        return self._prefill_logits[:rows].copy_(self.model.lm_head(last))

    def _capture_prefill(self, size: int) -> None:
        """Captures the prefill pass of flat-batch size ``size`` (the pass buffers hold a real pass; capture
        records without running). Captured on a side stream in thread-local mode, without the device-wide
        synchronisation of ``torch.cuda.graph``: other threads (the trainer) keep running meanwhile."""
        started = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        side = self._prefill_capture_stream
        side.wait_stream(torch.cuda.current_stream())
        if self._prefill_pool is None:
            self._prefill_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._prefill_pool, capture_error_mode="thread_local")
            try:
                self._prefill_forward(size)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self._prefill_graphs[size] = graph
        self.graph_capture_seconds += time.perf_counter() - started

    def set_block_tables(self, tables: np.ndarray) -> None:
        """Copies the host block tables (``[num_rows + 1, max_len // block_size]`` int32) to the device, ordered
        after the work already queued on the current stream (a step in flight reads the tables it was
        launched with); the host does not wait."""
        (flat,) = lists_to_device([tables.reshape(-1)], self.device, dtype=torch.int32)
        self.block_tables.view(-1).copy_(flat)

    def read_kv(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row ``row``'s K/V at positions ``start..end-1`` of every layer: ``(k, v)``, each
        ``[layers, KV, end - start, d]`` in the cache's dtype."""
        positions = torch.arange(start, end, device=self.device)
        blocks = self.block_tables[row, positions // self.block_size].long()
        offsets = positions % self.block_size
        # [n, layers, KV, d] (the advanced indices' dimension first) -> [layers, KV, n, d]
        return tuple(cache[:, blocks, :, offsets].permute(1, 2, 0, 3).contiguous() for cache in (self.k_cache, self.v_cache))

    def write_kv(self, row: int, start: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Writes ``kv`` (as returned by :meth:`read_kv`) into row ``row``'s blocks from position ``start`` on."""
        positions = torch.arange(start, start + kv[0].shape[2], device=self.device)
        blocks = self.block_tables[row, positions // self.block_size].long()
        offsets = positions % self.block_size
        for cache, values in zip((self.k_cache, self.v_cache), kv):
            cache[:, blocks, :, offsets] = values.permute(2, 0, 1, 3)

    def copy_blocks(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copies the K/V of blocks ``sources[i]`` into blocks ``targets[i]`` (distinct) in every layer (an indexed
        assignment: the CPU has no ``index_copy_`` for fp8)."""
        source, target = lists_to_device([list(sources), list(targets)], self.device)
        for cache in (self.k_cache, self.v_cache):
            cache[:, target] = cache.index_select(1, source)

    def set_decode_inputs(self, tokens: Sequence[int], positions: Sequence[int], lora_slots: Sequence[int],
                          prefix_rows: Sequence[int] | None = None, prefix_lens: Sequence[int] | None = None,
                          from_sampled: Sequence[int] | None = None, rows: Sequence[int] | None = None) -> None:
        """Writes the decode input buffers' first ``len(tokens)`` batch positions (one host-to-device copy; lists or
        int numpy arrays): ``rows`` names each position's cache row (default: position ``i`` runs cache row ``i``;
        an idle position runs the scratch row :attr:`scratch_row` at position 0); the prefix sequences (both or
        neither) name each position's shared-prefix source (a batch position) and length; a position whose
        ``from_sampled`` is 1 takes its token from its cache row's :attr:`sampled_tokens` instead."""
        num = len(tokens)
        shared = prefix_rows is not None
        values = [tokens, positions, lora_slots, range(num) if rows is None else rows]
        values += [prefix_rows, prefix_lens] if shared else []
        staged = lists_to_device(values + ([from_sampled] if from_sampled is not None else []), self.device)
        targets = [self.decode_tokens, self.decode_positions, self.decode_slots, self.decode_rows]
        targets += [self.decode_prefix_rows, self.decode_prefix_lens] if shared else []
        for target, values_t in zip(targets, staged):
            target[:num].copy_(values_t)
        if from_sampled is not None:
            torch.where(staged[-1].bool(), self.sampled_tokens.index_select(0, staged[3]), staged[0],
                        out=self.decode_tokens[:num])

    def record_sampled(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Keeps ``tokens: [N]`` (int64, drawn on the device) as cache rows ``rows: [N]``'s :attr:`sampled_tokens`."""
        self.sampled_tokens.index_copy_(0, rows, tokens)

    @torch.no_grad()
    def decode(self, span: int) -> torch.Tensor:
        """One decode step for batch positions ``0..span-1`` from the decode input buffers -> logits ``[span, V]``
        in the model dtype (the sampler computes in fp32 from them; a ``[512, 151936]`` fp32 copy would cost
        311 MB of writes per step). Writes each position's new K/V at its position (must be < max_len) through its
        cache row; idle positions (the scratch row) carry any token and position, and their outputs are ignored by the
        caller.

        Callers keep ``span`` a multiple of :data:`DECODE_ROW_QUANTUM`: the base GEMMs then give each row
        the same bits for every such span (seen on the CPU, one thread), so a row's numbers still do not
        depend on how many other rows run. With captured graphs the smallest bucket ``>= span`` is replayed, its
        positions past ``span`` idle on the scratch row, reading no other position's prefix."""
        for bucket, graph in sorted(self._graphs.items()):
            if bucket >= span:
                self.decode_rows[span:bucket].fill_(self.scratch_row)
                self.decode_prefix_rows[span:bucket].copy_(self._batch_index[span:bucket])
                self.decode_prefix_lens[span:bucket].zero_()
                graph.replay()
                return self._decode_logits[:span]
        return self._decode_eager(span)

    def capture_graphs(self) -> float:
        """Captures one decode CUDA graph per span bucket (:func:`decode_buckets`), largest first so that the
        smaller ones reuse its memory pool, and turns on prefill graphs (captured on first use, in a pool of
        their own). Call before any request runs: the warm-up passes write K/V at the buffers' positions.
        Returns the seconds the decode graphs took (:attr:`graph_capture_seconds` adds the prefill ones)."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for span in decode_buckets(self.num_rows):  # warm-up: compiles the Triton kernels
                self._decode_eager(span)
        torch.cuda.current_stream().wait_stream(side)
        for span in sorted(decode_buckets(self.num_rows), reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._decode_eager(span)
            self._graphs[span] = graph
        torch.cuda.synchronize()
        self.prefill_graphs = True
        seconds = time.perf_counter() - started
        self.graph_capture_seconds += seconds
        return seconds

    @torch.no_grad()
    def _decode_eager(self, span: int) -> torch.Tensor:
        tokens, positions = self.decode_tokens[:span], self.decode_positions[:span]
        lengths = positions + 1  # each row sees its own cache row up to and including its position
        tables = torch.index_select(self.block_tables, 0, self.decode_rows[:span], out=self._decode_tables[:span])
        prefix_rows = self.decode_prefix_rows[:span] if self.share_prefix_reads else None
        prefix_lens = self.decode_prefix_lens[:span] if self.share_prefix_reads else None

        def attend(layer_idx: int, q: torch.Tensor) -> torch.Tensor:
            # q: [span, H, d]
            return decode_attention(q, self.k_cache[layer_idx], self.v_cache[layer_idx], lengths,
                                    workspace=self._attention_workspace, prefix_rows=prefix_rows, prefix_lens=prefix_lens,
                                    block_tables=tables)

        hidden = self._forward(tokens, positions, self.decode_slots[:span], tables, self._batch_index[:span], attend)
        return torch.mm(hidden, self.model.lm_head.weight.t(), out=self._decode_logits[:span])

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_slots: torch.Tensor,
                 tables: torch.Tensor, table_rows: torch.Tensor, attend) -> torch.Tensor:
        """The decoder stack over a flat batch ``input_ids: [T]`` at ``position_ids: [T]``, each token's k and v
        written at its position through row ``table_rows[t]`` of the block tables ``tables``; ``attend(layer, q)``
        (``q: [T, H, d]`` -> ``[T, H, d]``) attends over the cache. Returns the final hidden states ``[T, hidden]``."""
        rows = input_ids.shape[0]
        x = self.decoder.embed_tokens(input_ids)
        cos, sin = self.decoder.rotary_emb(x[None], position_ids[None])  # [1, T, d] each
        cos, sin = cos[0], sin[0]
        residual = None
        if self.lora_meta is not None:
            self.lora_meta.build(token_slots)
        # Each token's K/V go to block ``block_tables[row, position // block_size]`` at ``position % block_size``.
        write_blocks = tables[table_rows, position_ids // self.block_size].long()
        write_offsets = position_ids % self.block_size
        for layer_idx, (layer, projections) in enumerate(zip(self.decoder.layers, self._projections)):
            norm = layer.input_layernorm
            hidden, residual = rms_norm(x, norm.weight, norm.variance_epsilon, residual)
            attn, qkv = layer.self_attn, projections.qkv
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            cache = KVCacheWrite(self.k_cache[layer_idx], self.v_cache[layer_idx], write_blocks, write_offsets)
            q = folded_qkv_rope_into_cache(
                hidden, qkv.folded, qkv.lora_b, qkv.scales, token_slots, self.head_dim, cos, sin,
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                0.0 if q_norm is None else q_norm.variance_epsilon, cache, meta=self.lora_meta)
            out = attend(layer_idx, q)  # [T, H, d]
            (x,) = projections.o(out.reshape(rows, -1), token_slots, self.lora_meta)
            norm = layer.post_attention_layernorm
            hidden, residual = rms_norm(x, norm.weight, norm.variance_epsilon, residual)
            gate, up = projections.gate_up(hidden, token_slots, self.lora_meta)
            (x,) = projections.down(silu_mul(gate, up), token_slots, self.lora_meta)
        hidden, _ = rms_norm(x, self.decoder.norm.weight, self.decoder.norm.variance_epsilon, residual)
        return hidden
