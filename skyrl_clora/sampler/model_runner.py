"""Runs a Hugging Face decoder (Qwen3 / Qwen2 / Llama module layout) over a slot-based KV cache.

The HF modules supply the weights and sub-layers (embeddings, norms, projections with multi-LoRA, MLP,
rotary embedding); this runner replaces only the attention bookkeeping so that many sequences of
different lengths decode together:

- ``prefill(jobs)``: several prompts written into their cache rows in fixed-size, position-aligned blocks
  (so a block's K/V can be cached and reused by any prompt with the same prefix), one block of each
  prompt per forward pass; returns each prompt's last-token logits ``[V]``.
- ``decode(tokens, positions, lora_slots)``: one token for every cache row at once (``[S]``, rows that are
  not running carry any token and are ignored by the caller); each row attends to its own cache row up to
  its position. The batch is always all ``S`` rows, so a row's numbers never depend on which other
  sequences are running (reproducible whatever the mix of tenants).

KV cache: per layer ``k, v: [S, kv_heads, max_len, head_dim]`` in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from skyrl_clora.lora.layers import LoRARouting

DECODE_ROW_QUANTUM = 16  # decode batches are whole multiples of this many cache rows


@dataclass
class PrefillJob:
    """One prompt to prefill: ``tokens: [T]`` into cache row ``row`` from position ``start`` on."""

    row: int
    tokens: torch.Tensor
    lora_slot: int
    start: int = 0


class ModelRunner:
    """Forward passes of a causal LM over a slot-based KV cache (see module docstring)."""

    def __init__(self, model: nn.Module, routing: LoRARouting, num_rows: int, max_len: int, block_size: int = 16) -> None:
        if max_len % block_size:
            raise ValueError(f"max_len {max_len} must be a multiple of the prefill block size {block_size}")
        self.model = model.eval()
        self.routing = routing
        self.decoder = model.model
        config = model.config
        self.num_rows = num_rows
        self.max_len = max_len
        self.block_size = block_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (num_rows, self.num_kv_heads, max_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.decoder.layers]
        self.v_cache = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.decoder.layers]
        self._row_index = torch.arange(num_rows, device=self.device)
        self._key_positions = torch.arange(max_len, device=self.device)

    @torch.no_grad()
    def prefill(self, jobs: list[PrefillJob]) -> list[torch.Tensor]:
        """Prefills several prompts together; returns each one's last-token logits ``[V]`` (fp32).

        Job ``i`` fills cache row ``rows[i]`` at positions ``start..T-1`` from ``tokens: [T]`` (positions
        ``< start`` must already hold the prompt's K/V, e.g. copied from the prefix cache).

        Prompts are computed in fixed blocks of ``block_size`` positions aligned at multiples of
        ``block_size`` (the last block padded; real tokens never attend to padding), one block of every
        unfinished job per forward pass, so the K/V of a block depend only on the tokens up to its end,
        not on the prompt's length, where the prefill started or which prompts shared the pass: a cached
        block is bit-identical to a recomputed one. ``start`` must be a multiple of ``block_size``.
        """
        block = self.block_size
        for job in jobs:
            if job.start % block or job.start >= job.tokens.shape[0]:
                raise ValueError(f"prefill start {job.start} must be a multiple of {block} below the prompt length")
        logits: list[torch.Tensor | None] = [None] * len(jobs)
        offsets = [job.start for job in jobs]
        while True:
            active = [i for i, job in enumerate(jobs) if offsets[i] < job.tokens.shape[0]]
            if not active:
                return logits
            chunks, positions, reals = [], [], []
            for i in active:
                chunk = jobs[i].tokens[offsets[i] : offsets[i] + block]
                reals.append(chunk.shape[0])
                chunks.append(torch.cat([chunk, chunk.new_zeros(block - chunk.shape[0])]))
                positions.append(torch.arange(offsets[i], offsets[i] + block, device=self.device))
            starts = [offsets[i] for i in active]
            rows = [jobs[i].row for i in active]

            def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                # q: [B, H, block, d]; k, v: [B, KV, block, d]; each prompt attends to its own cache row.
                k_cache, v_cache = self.k_cache[layer_idx], self.v_cache[layer_idx]
                outputs = []
                for b, (row, lo) in enumerate(zip(rows, starts)):
                    hi = lo + block
                    k_cache[row, :, lo:hi] = k[b]
                    v_cache[row, :, lo:hi] = v[b]
                    visible = self._key_positions[:hi].view(1, -1) <= self._key_positions[lo:hi].view(-1, 1)
                    outputs.append(torch.nn.functional.scaled_dot_product_attention(
                        q[b : b + 1], k_cache[row : row + 1, :, :hi], v_cache[row : row + 1, :, :hi],
                        attn_mask=visible, enable_gqa=self.num_kv_heads != self.num_heads,
                    ))
                return torch.cat(outputs)

            token_slots = torch.tensor([jobs[i].lora_slot for i in active], device=self.device).repeat_interleave(block)
            hidden = self._forward(torch.stack(chunks), torch.stack(positions), token_slots, attend)
            for b, i in enumerate(active):
                offsets[i] += block
                if offsets[i] >= jobs[i].tokens.shape[0]:
                    logits[i] = self.model.lm_head(hidden[b, reals[b] - 1]).float()

    def read_blocks(self, row: int, first_block: int, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row ``row``'s K/V for blocks ``first_block..first_block+num_blocks-1``: one
        ``(k, v)`` pair per layer, each ``[KV, num_blocks * block_size, d]``."""
        lo, hi = first_block * self.block_size, (first_block + num_blocks) * self.block_size
        return [(k[row, :, lo:hi].clone(), v[row, :, lo:hi].clone()) for k, v in zip(self.k_cache, self.v_cache)]

    def write_block(self, row: int, block_index: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies one block's K/V (as returned by :meth:`read_blocks` with ``num_blocks=1``) into row ``row``."""
        lo, hi = block_index * self.block_size, (block_index + 1) * self.block_size
        for (k, v), k_cache, v_cache in zip(kv, self.k_cache, self.v_cache):
            k_cache[row, :, lo:hi].copy_(k)
            v_cache[row, :, lo:hi].copy_(v)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, lora_slots: torch.Tensor) -> torch.Tensor:
        """One decode step for cache rows ``0..N-1``: ``tokens, positions, lora_slots: [N]`` -> logits ``[N, V]``
        (fp32), ``N <= num_rows``. Writes each row's new K/V at ``positions[row]`` (must be < max_len).

        Callers keep ``N`` a multiple of :data:`DECODE_ROW_QUANTUM`: the base GEMMs then give each row
        the same bits for every such ``N`` (seen on the CPU, one thread), so a row's numbers still do
        not depend on how many other rows run."""
        num = tokens.shape[0]
        # Keys a row may see: its own cache row up to and including its position.
        visible = self._key_positions.view(1, 1, 1, -1) <= positions.view(-1, 1, 1, 1)  # [S, 1, 1, L]

        def attend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: [S, H, 1, d]; k, v: [S, KV, 1, d]
            k_cache, v_cache = self.k_cache[layer_idx][:num], self.v_cache[layer_idx][:num]
            k_cache[self._row_index[:num], :, positions] = k[:, :, 0]
            v_cache[self._row_index[:num], :, positions] = v[:, :, 0]
            return torch.nn.functional.scaled_dot_product_attention(
                q, k_cache, v_cache, attn_mask=visible, enable_gqa=self.num_kv_heads != self.num_heads
            )

        hidden = self._forward(tokens.view(-1, 1), positions.view(-1, 1), lora_slots, attend)
        return self.model.lm_head(hidden[:, 0]).float()

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, token_slots: torch.Tensor, attend) -> torch.Tensor:
        """The decoder stack over ``input_ids: [B, T]``; ``attend(layer, q, k, v)`` does cache I/O and attention.
        Returns final hidden states ``[B, T, hidden]``."""
        hidden = self.decoder.embed_tokens(input_ids)
        cos, sin = self.decoder.rotary_emb(hidden, position_ids)
        batch, length = input_ids.shape
        with self.routing.route(token_slots):
            for layer_idx, layer in enumerate(self.decoder.layers):
                residual = hidden
                hidden = layer.input_layernorm(hidden)
                attn = layer.self_attn
                q = attn.q_proj(hidden).view(batch, length, -1, self.head_dim)
                k = attn.k_proj(hidden).view(batch, length, -1, self.head_dim)
                v = attn.v_proj(hidden).view(batch, length, -1, self.head_dim).transpose(1, 2)
                if hasattr(attn, "q_norm"):
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                out = attend(layer_idx, q, k, v)  # [B, H, T, d]
                hidden = residual + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
                residual = hidden
                hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.decoder.norm(hidden)
