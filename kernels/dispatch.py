"""Picks the implementation of each op (multi-LoRA, decode and prefill attention, fused layer ops, token
sampling): Triton for CUDA tensors, the torch reference elsewhere.

Layers call only ``add_lora``, ``lora_linear`` (``packed_lora`` plus the base layer) and ``dense_lora_linear``;
the sampling engine's model runner calls ``folded_qkv_rope_into_cache`` (``qkv_dispatch``), ``folded_lora_linear``,
``decode_attention``, ``prefill_attention``, ``rms_norm`` and ``silu_mul``; the trainer's model calls
``rms_norm_with_grad``, ``silu_mul_with_grad`` and ``rope_with_grad``, its shared-prompt attention
``gather_rows``, its LM-head loss ``chosen_logprobs_``; the engine's sampler calls ``sample_tokens``.
``backend="triton"`` forces the Triton kernels, which on CPU tensors run only under the Triton interpreter
(``TRITON_INTERPRET=1``, as the CPU tests do); ``backend="torch"`` forces the reference.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from skyrl_clora.kernels.attention.decode import DecodeWorkspace, decode_attention_triton
from skyrl_clora.kernels.checks import (
    check_chosen_logprobs,
    check_frozen_base,
    check_prefill_attention,
    check_silu_mul,
)
from skyrl_clora.kernels.lora.dense_lora import DenseLoRALinear
from skyrl_clora.kernels.lora.folded import FoldedWeights, fold_pays, folded_lora_linear_triton
from skyrl_clora.kernels.layers.gather_ops import GatherRows
from skyrl_clora.kernels.layers.logprob_ops import chosen_logprobs_triton
from skyrl_clora.kernels.lora.meta import LoRAMeta
from skyrl_clora.kernels.lora.packed import packed_lora_triton
from skyrl_clora.kernels.attention.prefill import prefill_attention_triton
from skyrl_clora.kernels.layers.layer_ops import qk_norm_rope_triton, rms_norm_triton, silu_mul_triton
from skyrl_clora.kernels.reference import (
    add_lora_ref,
    chosen_logprobs_ref,
    decode_attention_ref,
    packed_lora_ref,
    prefill_attention_ref,
    qk_norm_rope_ref,
    rms_norm_ref,
    sample_tokens_ref,
    silu_mul_ref,
)
from skyrl_clora.kernels.layers.sampling import sample_tokens_triton
from skyrl_clora.kernels.lora.sgmv import add_lora_triton
from skyrl_clora.kernels.layers.train_ops import RMSNormFrozenWeight, RotaryEmbedding, SiluMul

Backend = Literal["triton", "torch"]


def use_triton(x: torch.Tensor, backend: Backend | None) -> bool:
    if backend is None:
        return x.is_cuda
    if backend == "torch":
        return False
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return True


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    meta: LoRAMeta | None = None,
    backend: Backend | None = None,
) -> None:
    """In place: ``out[t, slice_i] += scales[s] * (x[t] @ A_i[s].T) @ B_i[s].T`` for ``s = token_slots[t] >= 0``.

    Shapes: ``out: [T, sum(H_out_i)]``, ``x: [T, H_in]``, ``lora_a: [S, R, H_in]`` (one A per slot) or
    ``[len(lora_b), S, R, H_in]`` (one per slice), ``lora_b[i]: [S, H_out_i, R]`` (at most 3 slices on the
    Triton path), ``scales: [S]`` float32, ``token_slots: [T]`` int64/int32 in ``[-1, S)``. Torch
    pseudo-code::

        offset = 0
        for i, b in enumerate(lora_b):
            a = lora_a[i] if lora_a.dim() == 4 else lora_a
            for t in range(T):
                s = token_slots[t]
                if s >= 0:
                    out[t, offset:offset + b.shape[1]] += scales[s] * (x[t] @ a[s].T) @ b[s].T
            offset += b.shape[1]

    Only ``out`` is written, and only in rows with a slot. The Triton path accumulates in fp32 and
    rounds ``scale * (x @ A.T)`` to the weights' dtype before the second product (as a bf16 PEFT layer
    does); it needs one dtype for ``out``, ``x`` and the weights, unit feature strides for ``out`` and
    ``x``, and contiguous weights, and raises ValueError otherwise.

    ``meta``: a :class:`LoRAMeta` on which ``meta.build(token_slots)`` was called for this batch. With it
    the Triton path allocates nothing and never waits for the host (capturable in a CUDA graph); without
    it a meta is built per call. The torch path ignores it.
    """
    if use_triton(x, backend):
        add_lora_triton(out, x, lora_a, tuple(lora_b), scales, token_slots, meta=meta)
    else:
        add_lora_ref(out, x, lora_a, tuple(lora_b), scales, token_slots)


def folded_lora_linear(
    x: torch.Tensor,
    folded: FoldedWeights,
    lora_b: Sequence[torch.Tensor],
    scales: torch.Tensor,
    token_slots: torch.Tensor | None,
    *,
    meta: LoRAMeta | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """An inference linear layer with multi-LoRA, its slots' A folded into its weight (``kernels.lora.folded``).

    Returns ``y = x @ folded.base_weight.T + folded.base_bias`` plus, for ``token_slots`` not None, the
    :func:`add_lora` terms with ``lora_a = folded.lora_a``: ``y[t, slice_i] += scales[s] * (x[t] @ A_i[s].T) @
    B_i[s].T`` for ``s = token_slots[t] >= 0``. Shapes: ``x: [T, H_in]``, ``lora_b[i]: [S, H_out_i, R]`` with
    ``sum(H_out_i) = folded.out_features``; returns ``[T, H_out]`` with unit column stride (on the folded path
    a column view of a ``[T, H_out + extra]`` GEMM output). The Triton path runs one GEMM over the whole folded
    weight and one segmented expand when ``kernels.lora.folded.fold_pays`` says the extra columns cost less than a
    shrink, and otherwise the base GEMM over ``folded.base_weight`` plus :func:`add_lora`, as the torch path
    always does. ``meta`` as for :func:`add_lora`.
    """
    lora_b = tuple(lora_b)
    if token_slots is None:
        return torch.nn.functional.linear(x, folded.base_weight, folded.base_bias)
    if use_triton(x, backend) and fold_pays(x.shape[0], folded.out_features, folded.extra_features):
        return folded_lora_linear_triton(x, folded, lora_b, scales, token_slots, meta)
    y = torch.nn.functional.linear(x, folded.base_weight, folded.base_bias)
    add_lora(y, x, folded.lora_a, lora_b, scales, token_slots, meta=meta, backend=backend)
    return y


def packed_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    meta: LoRAMeta | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Returns ``y[t] = scales[p] * (x[t] @ A[p].T) @ B[p].T`` for ``p = token_slots[t] >= 0``, else 0.

    Shapes: ``x: [T, H_in]``, ``lora_a: [P, R, H_in]``, ``lora_b: [P, H_out, R]``, ``scales: [P]`` float32,
    ``token_slots: [T]``; returns a new ``[T, H_out]`` tensor in ``x``'s dtype (nothing is written in
    place). Torch pseudo-code::

        y = zeros(T, H_out)
        for t in range(T):
            p = token_slots[t]
            if p >= 0:
                y[t] = scales[p] * (x[t] @ lora_a[p].T) @ lora_b[p].T

    Differentiable in ``x``, ``lora_a`` and ``lora_b`` (not in ``scales``): one backward gives every
    adapter's gradients. The Triton path (``kernels.lora.packed.PackedLoRAFunction``) runs the forward in one
    launch and the backward in two or three. ``meta`` as for :func:`add_lora` (a snapshot of its index buffers
    is kept for backward, so rebuilding it for the next micro-batch is safe).
    """
    if use_triton(x, backend):
        return packed_lora_triton(x, lora_a, lora_b, scales, token_slots, meta=meta)
    return packed_lora_ref(x, lora_a, lora_b, scales, token_slots)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    meta: LoRAMeta | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """A frozen linear layer with packed LoRA adapters: ``x @ weight.T + bias + packed_lora(x, ...)``.

    Shapes as :func:`packed_lora`, plus ``weight: [H_out, H_in]`` and ``bias: [H_out]`` (or None), both
    frozen; returns a new ``[T, H_out]``. Differentiable in ``x``, ``lora_a`` and ``lora_b``. The Triton
    path is one autograd node whose expand kernels add the LoRA terms into the base GEMMs' outputs (``y``
    forward, ``dx`` backward); the torch path is the base layer plus :func:`packed_lora`, in that order.
    """
    if use_triton(x, backend):
        return packed_lora_triton(x, lora_a, lora_b, scales, token_slots, meta=meta, weight=weight, bias=bias)
    return torch.nn.functional.linear(x, weight, bias) + packed_lora_ref(x, lora_a, lora_b, scales, token_slots)


def dense_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    slot: int,
) -> torch.Tensor:
    """:func:`lora_linear` for a batch whose rows all use adapter ``slot`` (the trainer's one-tenant pass): the
    same values (up to rounding: ``scales[slot] * x @ A.T`` is rounded to the model dtype) from plain torch
    GEMMs on every device (``kernels.lora.dense_lora``), differentiable in ``x``, ``lora_a`` and ``lora_b``."""
    if not 0 <= slot < lora_a.shape[0]:
        raise ValueError(f"slot {slot} is outside the adapters' {lora_a.shape[0]} slots")
    check_frozen_base(weight, bias)
    return DenseLoRALinear.apply(x, weight, bias, lora_a, lora_b, scales, slot)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """One decode step's attention over a slot or paged KV cache; returns ``out`` (written in place if given).

    Shapes: ``q: [B, H, d]``; ``k_cache, v_cache: [S, KV, L, d]`` with ``S >= B`` (row ``b`` of ``q`` reads
    cache row ``b``); ``lengths: [B]`` int32/int64 with ``1 <= lengths[b] <= L`` (a length of 0 gives
    zeros); ``H % KV == 0`` (GQA: head ``h`` reads kv head ``h // (H // KV)``); ``out: [B, H, d]``. One
    dtype (bf16, fp16 or fp32) for ``q``, the caches and ``out``, or the caches ``torch.float8_e4m3fn`` (scale 1.0:
    converted to ``q``'s dtype as they are read); fp32 accumulation. Torch pseudo-code::

        for b in range(B):
            for h in range(H):
                k = k_cache[b, h // (H // KV), :lengths[b]]              # [lengths[b], d]
                v = v_cache[b, h // (H // KV), :lengths[b]]
                out[b, h] = softmax(q[b, h] @ k.T / sqrt(d)) @ v

    With ``prefix_rows``/``prefix_lens`` (``[B]`` ints, both or neither), row ``b`` reads its positions below
    ``prefix_lens[b]`` from cache row ``prefix_rows[b]`` instead: rows whose prompts were copied from one
    cached prefix then read one copy of it (``decode_attention_ref`` states it as pseudo-code).

    Paged, with ``block_tables: [R, M]`` (int32, contiguous, ``R >= B``): ``k_cache, v_cache: [NB, KV, BS, d]``
    (``NB`` blocks of ``BS`` positions), logical row ``r``'s position ``p`` at ``k_cache[block_tables[r, p //
    BS], :, p % BS]``, logical length ``L = M * BS`` (the ``max_len`` of the :class:`DecodeWorkspace`). Row
    ``b`` reads through table row ``b``, and its positions below ``prefix_lens[b]`` through table row
    ``prefix_rows[b]``; table entries of blocks at or past what a row reads may hold anything (they are never
    dereferenced), and rows may share blocks. Torch pseudo-code::

        for b in range(B):
            n = min(lengths[b], M * BS)
            r = [prefix_rows[b] if p < prefix_lens[b] else b for p in range(n)]    # no prefix: all b
            for h in range(H):
                k = stack([k_cache[block_tables[r[p], p // BS], h // (H // KV), p % BS] for p in range(n)])
                v = stack([v_cache[block_tables[r[p], p // BS], h // (H // KV), p % BS] for p in range(n)])
                out[b, h] = softmax(q[b, h] @ k.T / sqrt(d)) @ v                   # [n, d] each

    Usage in a decode step (the new token's K/V already written at position ``lengths[b] - 1``)::

        ws = DecodeWorkspace(max_rows, H, L, d, device="cuda")       # once
        decode_attention(q, k_cache, v_cache, lengths, out=out, workspace=ws)   # every layer, every step

    The Triton path (``kernels.attention.decode``, flash-decoding) reads only the first ``lengths[b]`` positions
    of each row, needs unit stride along ``d`` and ``d <= 256``, and raises ValueError otherwise. With
    ``out`` and ``workspace`` given it allocates nothing and never waits for the host, so the step can be
    captured in a CUDA graph and replayed with new ``lengths`` (and block tables) copied into the captured
    tensors. The torch path (``reference.decode_attention_ref``) masks over all ``L`` positions and ignores
    ``workspace``; paged, it gathers the rows' blocks into a ``[B, KV, L, d]`` copy first and is then
    bit-identical to a slot call over that copy.
    """
    if use_triton(q, backend):
        return decode_attention_triton(q, k_cache, v_cache, lengths, out=out, workspace=workspace,
                                       prefix_rows=prefix_rows, prefix_lens=prefix_lens, block_tables=block_tables)
    return decode_attention_ref(q, k_cache, v_cache, lengths, out=out, prefix_rows=prefix_rows, prefix_lens=prefix_lens,
                                block_tables=block_tables)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    job_rows: torch.Tensor,
    job_starts: torch.Tensor,
    q_offsets: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    *,
    block_tables: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Attention of one layer for a ragged prefill pass, keys read straight from the KV cache (slot or paged);
    returns a new ``[T, H, d]`` in ``q``'s dtype.

    Shapes: ``q: [T, H, d]``, the pass's query tokens, job ``j``'s at ``q[q_offsets[j] : q_offsets[j] +
    q_lens[j]]`` (disjoint ranges in any order; ``q_lens[j] = 0``: an unused job slot); ``k_cache, v_cache:
    [S, KV, L, d]`` holding the pass's own K/V already; ``job_rows, job_starts, q_offsets, q_lens: [J]``
    int64; ``H % KV == 0`` (GQA: head ``h`` reads kv head ``h // (H // KV)``). One dtype (bf16, fp16 or fp32)
    for ``q`` and the caches, or the caches ``torch.float8_e4m3fn`` (scale 1.0: converted to ``q``'s dtype as they
    are read); fp32 softmax and accumulation, the output rounded once (the Triton path, like
    flash attention, rounds the softmax weights to the model dtype for their product with V). Torch
    pseudo-code::

        out = zeros(T, H, d)                                             # tokens of no job stay 0
        for j in range(J):
            for i in range(q_lens[j]):
                t, p = q_offsets[j] + i, job_starts[j] + i
                for h in range(H):
                    k = k_cache[job_rows[j], h // (H // KV), :p + 1]       # [p + 1, d]; v likewise
                    out[t, h] = softmax(scale * q[t, h] @ k.T) @ v

    Paged, with ``block_tables: [R, M]`` (int32, contiguous): ``k_cache, v_cache: [NB, KV, BS, d]``, logical
    length ``L = M * BS``, and job ``j`` reads through table row ``job_rows[j]`` (``< R``); entries of blocks
    past a job's last query position may hold anything (never dereferenced). The pseudo-code's ``k`` becomes::

                    k = stack([k_cache[block_tables[job_rows[j], i // BS], h // (H // KV), i % BS]
                               for i in range(p + 1)])                   # [p + 1, d]; v likewise

    The Triton path (``kernels.attention.prefill``) reads only each job's positions up to its last query
    (causal tiles), needs unit stride along ``d`` and ``d <= 256``, never waits for the host and allocates
    only ``out``: a prefill pass is capturable in a CUDA graph and replayable with new metadata copied into
    the same tensors. The torch path (``reference.prefill_attention_ref``, the CPU engine's) loops over the
    jobs on the host (paged, bit-identical to a slot call over the jobs' gathered blocks). Raises ValueError on
    bad shapes or dtypes.
    """
    if use_triton(q, backend):
        return prefill_attention_triton(q, k_cache, v_cache, job_rows, job_starts, q_offsets, q_lens, scale,
                                        block_tables=block_tables)
    check_prefill_attention(q, k_cache, v_cache, job_rows, job_starts, q_offsets, q_lens, block_tables)
    return prefill_attention_ref(q, k_cache, v_cache, job_rows, job_starts, q_offsets, q_lens, scale,
                                 block_tables=block_tables)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm after an optional residual add: returns ``(y, h)`` with ``h = x`` or ``residual + x``, both
    ``[N, H]`` like ``x``; ``weight: [H]``. Torch pseudo-code::

        h = x if residual is None else residual + x
        y = weight * (h / sqrt(mean(h ** 2, dim=-1, keepdim=True) + eps))      # statistics in fp32

    Nothing is written in place. The Triton path (``kernels.layers.layer_ops``) needs inputs of one float dtype with
    unit column stride (any row stride) and rounds once to it; the torch path is Hugging Face's RMSNorm op for op.
    """
    if use_triton(x, backend):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, *,
                 backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm (when ``q_weight``/``k_weight: [d]`` are given; ``None`` for models
    without it) then the rotary embedding, for ``q: [N, Hq, d]``, ``k: [N, Hk, d]``, ``cos, sin: [N, d]``
    (the model's rotary tables at each token's position). Returns new ``(q, k)``. Torch pseudo-code::

        for x, w in ((q, q_weight), (k, k_weight)):
            if w is not None:
                x = w * x / sqrt(mean(x ** 2, dim=-1, keepdim=True) + eps)
            x = x * cos[:, None] + cat(-x[..., d // 2:], x[..., :d // 2], -1) * sin[:, None]

    The Triton path runs every head of q and k in one launch (power-of-two ``d``).
    """
    if use_triton(q, backend):
        return qk_norm_rope_triton(q, k, cos, sin, q_weight, k_weight, eps)
    return qk_norm_rope_ref(q, k, cos, sin, q_weight, k_weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for two tensors of one shape and dtype (a new tensor)."""
    if use_triton(gate, backend):
        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)


def rms_norm_with_grad(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       backend: Backend | None = None) -> torch.Tensor:
    """Differentiable RMSNorm of ``x: [..., H]`` over its last dim with a frozen ``weight: [H]`` (gradients
    reach ``x`` only; a ``weight`` that requires grad is refused). Torch pseudo-code::

        y = weight * (x / sqrt(mean(x ** 2, dim=-1, keepdim=True) + eps))      # statistics in fp32

    The Triton path (``kernels.layers.train_ops``) is one launch forward and one backward; the torch path is Hugging
    Face's RMSNorm op for op, differentiated by autograd.
    """
    if weight.requires_grad:
        raise ValueError("rms_norm_with_grad needs a frozen weight (requires_grad=False)")
    if use_triton(x, backend):
        return RMSNormFrozenWeight.apply(x, weight, eps)
    return rms_norm_ref(x, weight, eps)[0]


def silu_mul_with_grad(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend | None = None) -> torch.Tensor:
    """Differentiable ``silu(gate) * up`` for two tensors of one shape and dtype. The Triton path
    (``kernels.layers.train_ops``) is one launch forward and one backward and saves only ``gate`` and ``up``."""
    check_silu_mul(gate, up)
    if use_triton(gate, backend):
        return SiluMul.apply(gate, up)
    return silu_mul_ref(gate, up)


def rope_with_grad(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                   backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of ``q: [N, Hq, d]`` and ``k: [N, Hk, d]`` with ``cos, sin: [N, d]``, differentiable
    in ``q`` and ``k`` (the trainer's). Returns new ``(q, k)``; semantics as :func:`qk_norm_rope` without
    weights::

        x = x * cos[:, None] + cat(-x[..., d // 2:], x[..., :d // 2], -1) * sin[:, None]

    The Triton path (``train_ops.RotaryEmbedding``, one launch each way, power-of-two ``d``) computes in
    fp32 and rounds once, and its backward assumes both halves of ``sin``'s last dim are equal (as rotary
    tables are built); the torch path is Hugging Face's op sequence under autograd."""
    if use_triton(q, backend):
        return RotaryEmbedding.apply(q, k, cos, sin)
    return qk_norm_rope_ref(q, k, cos, sin, None, None, 0.0)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, *,
                  backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits: [N, V]`` (any float dtype; fp32 arithmetic), greedy where
    ``temperature: [N]`` (float32) is 0, else drawn by inverse CDF with the row's ``uniform: [N]`` (float32,
    in ``[0, 1]``); returns ``(tokens [N] int64, logprobs [N] float32)`` on ``logits``' device, the
    log-probabilities under the untempered distribution. Torch pseudo-code, per row::

        if temperature == 0:
            token = argmax(logits)                                      # the first maximum
        else:
            p = softmax(logits / temperature)
            token = first index with cumsum(p)[token] > uniform * sum(p)   # else the last index with p > 0
        logprob = logits[token] - logsumexp(logits)

    The torch path (``reference.sample_tokens_ref``) sums the CDF in blocks of 1024 tokens; the Triton path
    (``kernels.layers.sampling``, one launch) sums unnormalised probabilities in its own order, so the two draw
    different tokens only where the target lies within rounding of a cumulative sum. Neither waits for the
    host. Top-p is not here (the sampler keeps its sort-based path for those rows).
    """
    if use_triton(logits, backend):
        return sample_tokens_triton(logits, temperature, uniform)
    return sample_tokens_ref(logits, temperature, uniform)


def chosen_logprobs_(logits: torch.Tensor, targets: torch.Tensor, *, write_grad: bool,
                     backend: Backend | None = None) -> torch.Tensor:
    """Each row's chosen-token log-probability under ``logits: [N, V]`` (any float dtype, unit column stride;
    fp32 arithmetic) for ``targets: [N]`` int64, as ``[N]`` float32; with ``write_grad`` also overwrites
    ``logits`` with that log-probability's gradient with respect to the row's logits. Torch pseudo-code::

        out = log_softmax(logits.float(), -1).gather(1, targets[:, None])[:, 0]
        if write_grad:
            logits[:] = one_hot(targets, V) - softmax(logits.float(), -1)

    The Triton path (``kernels.layers.logprob_ops``) is one launch that reads each row twice and writes it once;
    the torch path is ``reference.chosen_logprobs_ref``. No host synchronisation."""
    check_chosen_logprobs(logits, targets)
    if use_triton(logits, backend):
        return chosen_logprobs_triton(logits, targets, write_grad)
    return chosen_logprobs_ref(logits, targets, write_grad)


def gather_rows(x: torch.Tensor, index: torch.Tensor, starts: torch.Tensor, sources: torch.Tensor, *,
                backend: Backend | None = None) -> torch.Tensor:
    """``x.index_select(0, index)`` for ``x: [N, ...]`` and ``index: [K]`` int64, differentiable in ``x``;
    ``(starts [N + 1], sources [K])`` is ``gather_ops.inverse_index(index, N)`` on ``x``'s device. Torch
    pseudo-code of the gradient::

        dx = zeros_like(x).index_add_(0, index, dy)      # = sum of dy[sources[starts[t]:starts[t + 1]]]

    The Triton path (``kernels.layers.gather_ops``) sums each row's gradients in fp32 in one launch, without
    atomics; the torch path is ``index_select`` under autograd (``index_add_`` backward)."""
    if use_triton(x, backend):
        return GatherRows.apply(x, index, starts, sources)
    return x.index_select(0, index)
