"""Runs a Hugging Face decoder (Qwen3 / Qwen2 / Llama module layout) over a slot-based KV cache.

The HF modules supply the weights (embeddings, norms, projections with multi-LoRA, MLP) and the rotary
tables; this runner replaces the attention bookkeeping, so that many sequences of different lengths decode
together, runs each layer's q/k/v and gate/up projections as one GEMM and one multi-slice LoRA call each
(``fused_projections``), and runs the element-wise parts of each layer through the kernels' fused ops
(RMSNorm with the residual add, q/k norm with the rotary embedding, SiLU-mul: one Triton launch each on the
GPU; on the CPU their references, which are Hugging Face's own ops in order):

- ``prefill(jobs)``: several prompts written into their cache rows in chunks, one chunk of each prompt per
  forward pass of at most ``prefill_tokens`` positions, from any start position (the positions before it
  already hold the prompt's K/V: cached blocks or a finished turn's history); returns each prompt's
  last-token logits ``[V]``.
- ``decode(span)``: one token for each of the cache rows ``0..span-1`` from the runner's decode input
  buffers (``set_decode_inputs``); each row attends to its own cache row up to its position (with
  ``share_prefix_reads``, its first positions from the row the engine names as holding the same K/V). On CUDA the
  step is replayed from a CUDA graph captured per span bucket (``capture_decode_graphs``): the inputs,
  the LoRA slot buffers and the segment metadata live in fixed buffers, so in-place adapter publishes and
  new inputs are seen by the replay.

KV cache: ``k_cache, v_cache: [layers, S, kv_heads, max_len, head_dim]`` in the model dtype (one tensor
each, so a prompt block of every layer is copied in one operation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from skyrl_clora.device_copy import lists_to_device
from skyrl_clora.gpu_settings import avoid_cudnn_attention
from skyrl_clora.kernels import DecodeWorkspace, LoRAMeta, decode_attention, qk_norm_rope, rms_norm, silu_mul
from skyrl_clora.lora.layers import LoRARouting
from skyrl_clora.profiling import profiled
from skyrl_clora.sampler.fused_projections import fused_layer_projections

DECODE_ROW_QUANTUM = 16  # decode batches are whole multiples of this many cache rows
CHUNK_QUANTUM = 16  # a prefill pass's chunks are padded to whole multiples of this many positions


def decode_buckets(num_rows: int) -> list[int]:
    """Spans a CUDA graph is captured for: multiples of 16 up to 64, then of 64 (every span rounds up to one)."""
    buckets = [span for span in (16, 32, 48, 64) if span < num_rows]
    buckets += list(range(128, num_rows, 64))
    return buckets + [num_rows]


@dataclass
class PrefillJob:
    """One prompt to prefill: ``tokens: [T]`` into cache row ``row`` from position ``start`` on."""

    row: int
    tokens: torch.Tensor
    lora_slot: int
    start: int = 0


class ModelRunner:
    """Forward passes of a causal LM over a slot-based KV cache (see module docstring)."""

    def __init__(self, model: nn.Module, routing: LoRARouting, num_rows: int, max_len: int, block_size: int,
                 prefill_tokens: int, share_prefix_reads: bool = False) -> None:
        if max_len % block_size:
            raise ValueError(f"max_len {max_len} must be a multiple of the prefill block size {block_size}")
        if num_rows % DECODE_ROW_QUANTUM:
            raise ValueError(f"num_rows {num_rows} must be a multiple of {DECODE_ROW_QUANTUM}")
        self.model = model.eval()
        avoid_cudnn_attention()
        self.routing = routing
        self.decoder = model.model
        config = model.config
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"the embedded engine runs SwiGLU MLPs (hidden_act=silu); this model has {config.hidden_act}")
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
        shape = (len(self.decoder.layers), num_rows, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self._row_index = torch.arange(num_rows, device=self.device)
        self._key_positions = torch.arange(max_len, device=self.device)
        # Decode inputs (written by set_decode_inputs, read by eager steps and graph replays).
        self.decode_tokens = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        self.decode_positions = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        self.decode_slots = torch.full((num_rows,), -1, dtype=torch.long, device=self.device)
        # Per row: the cache row holding its first ``decode_prefix_lens`` positions (decode_attention's
        # prefix_rows / prefix_lens), when share_prefix_reads.
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
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._projections = fused_layer_projections(self.decoder.layers)  # per layer: (q/k/v, gate/up)

    @torch.no_grad()
    @profiled("runner.prefill")
    def prefill(self, jobs: list[PrefillJob]) -> list[torch.Tensor]:
        """Prefills several prompts together; returns each one's last-token logits ``[V]`` (fp32).

        Job ``i`` fills cache row ``rows[i]`` at positions ``start..T-1`` from ``tokens: [T]`` (positions
        ``< start`` must already hold the prompt's K/V, e.g. copied from the prefix cache).

        A forward pass takes one chunk of every unfinished job (at most ``prefill_tokens // block_size``
        jobs), all chunks of the pass ``C`` positions long: the longest remainder rounded up to whole
        :data:`CHUNK_QUANTUM` positions, at most ``prefill_tokens // jobs`` rounded down to whole blocks, and
        none past ``max_len``; shorter chunks are padded (real tokens never attend to padding). So a pass
        computes at most ``prefill_tokens`` positions, a long prompt needs few passes and a short remainder
        (the next turn of an episode) is not padded to a whole block. A token's K/V depend only on the
        tokens up to it: on the CPU (one thread) bit for bit whatever the pass looks like, so a cached block
        equals a recomputed one; on the GPU up to the last bits of kernels that pick their reduction order
        by shape. ``start`` may be any position below ``T`` (a multiple of ``block_size`` when the positions
        before it come from the prefix cache, any when they are a finished turn's history).
        """
        block = self.block_size
        for job in jobs:
            if not 0 <= job.start < job.tokens.shape[0]:
                raise ValueError(f"prefill start {job.start} must be below the prompt length {job.tokens.shape[0]}")
        logits: list[torch.Tensor | None] = [None] * len(jobs)
        offsets = [job.start for job in jobs]
        max_jobs = self.prefill_tokens // block
        while True:
            active = [i for i, job in enumerate(jobs) if offsets[i] < job.tokens.shape[0]][:max_jobs]
            if not active:
                return logits
            longest = max(jobs[i].tokens.shape[0] - offsets[i] for i in active)
            room = self.max_len - max(offsets[i] for i in active)  # padding stays inside the cache rows
            chunk_len = min(-(-longest // CHUNK_QUANTUM) * CHUNK_QUANTUM, self.prefill_tokens // (len(active) * block) * block, room)
            chunks, reals = [], []
            for i in active:
                chunk = jobs[i].tokens[offsets[i] : offsets[i] + chunk_len]
                reals.append(chunk.shape[0])
                chunks.append(torch.cat([chunk, chunk.new_zeros(chunk_len - chunk.shape[0])]))
            starts, rows, slots = lists_to_device([[offsets[i] for i in active], [jobs[i].row for i in active],
                                                   [jobs[i].lora_slot for i in active]], self.device)
            query_positions = starts[:, None] + self._key_positions[:chunk_len][None]  # [B, C]
            # Keys every prompt of the pass attends over (masked past each query's position). On the CPU
            # all max_len positions, so that a prompt's shapes, and so its bits, never depend on the other
            # prompts of the pass; on the GPU up to the furthest chunk of the pass, in whole 16-key groups
            # (the mask alignment memory-efficient attention wants).
            width = self.max_len
            if self.device.type == "cuda":
                width = min(self.max_len, -(-(max(offsets[i] for i in active) + chunk_len) // 16) * 16)
            visible = (self._key_positions[:width][None, None] <= query_positions[:, :, None])[:, None]  # [B, 1, C, W]
            groups = self.num_heads // self.num_kv_heads

            def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                # q: [B, H, C, d]; k, v: [B, KV, C, d]; each prompt attends to its own cache row.
                k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
                k_cache[rows[:, None], :, query_positions] = k.transpose(1, 2)
                v_cache[rows[:, None], :, query_positions] = v.transpose(1, 2)
                keys, values = k_cache[rows, :, :width], v_cache[rows, :, :width]
                if groups > 1:  # query heads sharing K/V heads (GQA), repeated so that memory-efficient
                    # attention (no per-shape set-up, unlike cuDNN's: gpu_settings) takes the masked call
                    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
                return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible)

            token_slots = slots.repeat_interleave(chunk_len)
            hidden = self._forward(torch.stack(chunks), query_positions, token_slots, attend)
            finished = []
            for b, i in enumerate(active):
                offsets[i] += chunk_len
                if offsets[i] >= jobs[i].tokens.shape[0]:
                    finished.append((b, i))
            if finished:
                # One LM-head product for the finished prompts, padded to whole row quanta (a row gets the
                # same bits for any number of quanta).
                last = hidden[[b for b, _ in finished], [reals[b] - 1 for b, _ in finished]]  # [F, hidden]
                padded = -(-len(finished) // DECODE_ROW_QUANTUM) * DECODE_ROW_QUANTUM
                last = torch.cat([last, last.new_zeros(padded - len(finished), last.shape[1])])
                for (_, i), row_logits in zip(finished, self.model.lm_head(last).float()):
                    logits[i] = row_logits

    def read_kv(self, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row ``row``'s K/V at positions ``start..end-1`` of every layer: ``(k, v)``, each
        ``[layers, KV, end - start, d]``."""
        return self.k_cache[:, row, :, start:end].clone(), self.v_cache[:, row, :, start:end].clone()

    def write_kv(self, row: int, start: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copies ``kv`` (as returned by :meth:`read_kv`) into row ``row`` from position ``start`` on."""
        end = start + kv[0].shape[2]
        self.k_cache[:, row, :, start:end].copy_(kv[0])
        self.v_cache[:, row, :, start:end].copy_(kv[1])

    def set_decode_inputs(self, tokens: list[int], positions: list[int], lora_slots: list[int],
                          prefix_rows: list[int] | None = None, prefix_lens: list[int] | None = None) -> None:
        """Writes the decode input buffers' first ``len(tokens)`` rows (one host-to-device copy); the prefix
        lists (both or neither) name each row's shared-prefix source row and length."""
        num = len(tokens)
        values = [tokens, positions, lora_slots] + ([prefix_rows, prefix_lens] if prefix_rows is not None else [])
        staged = lists_to_device(values, self.device)
        targets = [self.decode_tokens, self.decode_positions, self.decode_slots, self.decode_prefix_rows, self.decode_prefix_lens]
        for target, values_t in zip(targets, staged):
            target[:num].copy_(values_t)

    @torch.no_grad()
    def decode(self, span: int) -> torch.Tensor:
        """One decode step for cache rows ``0..span-1`` from the decode input buffers -> logits ``[span, V]``
        (fp32). Writes each row's new K/V at its position (must be < max_len); rows that are not running
        carry any token and position, and their outputs are ignored by the caller.

        Callers keep ``span`` a multiple of :data:`DECODE_ROW_QUANTUM`: the base GEMMs then give each row
        the same bits for every such span (seen on the CPU, one thread), so a row's numbers still do not
        depend on how many other rows run. With captured graphs the smallest bucket ``>= span`` is replayed."""
        for bucket, (graph, logits) in sorted(self._graphs.items()):
            if bucket >= span:
                graph.replay()
                return logits[:span]
        return self._decode_eager(span)

    def capture_decode_graphs(self) -> float:
        """Captures one CUDA graph per span bucket (:func:`decode_buckets`), largest first so that the
        smaller ones reuse its memory pool. Call before any request runs: capturing writes K/V at the
        buffers' positions. Returns the seconds it took."""
        import time

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
                logits = self._decode_eager(span)
            self._graphs[span] = (graph, logits)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    @torch.no_grad()
    def _decode_eager(self, span: int) -> torch.Tensor:
        tokens, positions = self.decode_tokens[:span], self.decode_positions[:span]
        lengths = positions + 1  # each row sees its own cache row up to and including its position
        rows = self._row_index[:span]
        prefix_rows = self.decode_prefix_rows[:span] if self.share_prefix_reads else None
        prefix_lens = self.decode_prefix_lens[:span] if self.share_prefix_reads else None

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [span, H, 1, d]; k, v: [span, KV, 1, d]
            k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
            k_cache[rows, :, positions] = k[:, :, 0]
            v_cache[rows, :, positions] = v[:, :, 0]
            out = decode_attention(q[:, :, 0], k_cache, v_cache, lengths, workspace=self._attention_workspace,
                                   prefix_rows=prefix_rows, prefix_lens=prefix_lens)
            return out.unsqueeze(2)

        hidden = self._forward(tokens.view(-1, 1), positions.view(-1, 1), self.decode_slots[:span], attend)
        return self.model.lm_head(hidden[:, 0]).float()

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_slots: torch.Tensor, attend) -> torch.Tensor:
        """The decoder stack over ``input_ids: [B, T]``; ``attend(layer, q, k, v)`` does cache I/O and attention.
        Returns final hidden states ``[B, T, hidden]``."""
        batch, length = input_ids.shape
        rows = batch * length
        x = self.decoder.embed_tokens(input_ids)
        cos, sin = self.decoder.rotary_emb(x, position_ids)  # [B, T, d] each
        cos, sin = cos.reshape(rows, -1), sin.reshape(rows, -1)
        x = x.view(rows, -1)
        residual = None
        if self.lora_meta is not None:
            self.lora_meta.build(token_slots)
        with self.routing.route(token_slots, self.lora_meta):
            for layer_idx, (layer, (qkv_proj, gate_up_proj)) in enumerate(zip(self.decoder.layers, self._projections)):
                norm = layer.input_layernorm
                hidden, residual = rms_norm(x, norm.weight, norm.variance_epsilon, residual)
                attn = layer.self_attn
                q, k, v = qkv_proj(hidden, token_slots, self.lora_meta)
                q, k = q.view(rows, -1, self.head_dim), k.view(rows, -1, self.head_dim)
                v = v.reshape(batch, length, -1, self.head_dim).transpose(1, 2)
                q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                q, k = qk_norm_rope(q, k, cos, sin, None if q_norm is None else q_norm.weight,
                                    None if k_norm is None else k_norm.weight,
                                    0.0 if q_norm is None else q_norm.variance_epsilon)
                q = q.view(batch, length, -1, self.head_dim).transpose(1, 2)
                k = k.view(batch, length, -1, self.head_dim).transpose(1, 2)
                out = attend(layer_idx, q, k, v)  # [B, H, T, d]
                x = attn.o_proj(out.transpose(1, 2).reshape(rows, -1))
                norm = layer.post_attention_layernorm
                hidden, residual = rms_norm(x, norm.weight, norm.variance_epsilon, residual)
                gate, up = gate_up_proj(hidden, token_slots, self.lora_meta)
                x = layer.mlp.down_proj(silu_mul(gate, up))
        hidden, _ = rms_norm(x, self.decoder.norm.weight, self.decoder.norm.variance_epsilon, residual)
        return hidden.view(batch, length, -1)
