"""Pure-torch reference implementations of the multi-LoRA ops (and of the other ops of ``dispatch``).

These are the semantics every fast kernel must match (tests compare against them in fp32), and the
implementation the CPU path runs. Layouts follow vLLM/PEFT:

- ``lora_a[s]``: ``[R, H_in]`` (PEFT ``lora_A.weight``), stacked over slots: ``[S, R, H_in]``.
- ``lora_b[s]``: ``[H_out_i, R]`` (PEFT ``lora_B.weight``), stacked: ``[S, H_out_i, R]``, one tensor per
  output slice (a fused q/k/v or gate/up projection has several slices; a plain linear has one).
- ``scales``: ``[S]`` float32, PEFT's ``lora_alpha / r`` per slot.
- ``token_slots``: ``[T]`` int64, the adapter slot of each token row; ``-1`` means no adapter (base model).

A slot whose true rank is below ``R`` is zero-padded in A's rows and B's columns, which leaves the
result unchanged.
"""

from __future__ import annotations

import torch

CDF_BLOCK = 1024  # tokens per block of the two-level inverse CDF of sample_tokens_ref
MIN_TEMPERATURE = 1e-6  # sample_tokens clamps temperatures to it (greedy rows compute a draw they discard)
PREFILL_QUERY_QUANTUM = 16  # prefill_attention_ref pads each job's queries to whole multiples of this many rows


def add_lora_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    scales: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """Adds every row's LoRA delta to ``out`` in place (inference; no autograd).

    Semantics, for ``out: [T, sum(H_out_i)]``, ``x: [T, H_in]``::

        offset = 0
        for i, b in enumerate(lora_b):                      # b: [S, H_out_i, R]
            for t in range(T):
                s = token_slots[t]
                if s >= 0:
                    out[t, offset:offset + H_out_i] += scales[s] * (x[t] @ lora_a[s].T) @ b[s].T
            offset += H_out_i

    ``lora_a`` is ``[S, R, H_in]`` shared by all slices when the layer has one A per slot, or
    ``[num_slices, S, R, H_in]`` when each slice has its own A (fused q/k/v).
    Computes in fp32 and writes ``out`` in its own dtype.

    Implementation: each row's A and B are gathered by its slot (``[T, R, H_in]``, ``[T, H_out_i, R]``) and
    the row runs two batched row-vector products, ``[1, H_in] @ [H_in, R]`` then (scaled) ``[1, R] @ [R,
    H_out_i]``. Every product's shape depends only on ``R`` and the layer's sizes, never on the other rows of
    the batch, the number of slots ``S`` or the row's slot, so a row's result depends on none of them (batch and
    slot invariance: the embedded engine's runs are reproducible whatever the interleaving of tenants and
    however many device slots hold their adapters; one GEMM over every slot's stacked A would change its
    kernel, and the last bits of its results, with ``S``). Rows without a slot add exact zeros. Gathers
    ``T * R * (H_in + H_out_i)`` fp32 values per slice; no host synchronisation.
    """
    has_adapter = token_slots >= 0
    safe_slots = token_slots.clamp(min=0).long()
    row_scale = torch.where(has_adapter, scales.float().index_select(0, safe_slots), 0.0)  # [T]
    x32 = x.float()[:, None, :]  # [T, 1, H_in]
    per_slice_a = lora_a.dim() == 4
    offset = 0
    for i, b in enumerate(lora_b):
        a = lora_a[i] if per_slice_a else lora_a
        a_rows = a.index_select(0, safe_slots).float()  # [T, R, H_in]
        shrunk = torch.bmm(x32, a_rows.transpose(1, 2)) * row_scale[:, None, None]  # [T, 1, R]
        b_rows = b.index_select(0, safe_slots).float()  # [T, H_out_i, R]
        width = b.shape[1]
        out[:, offset : offset + width] += torch.bmm(shrunk, b_rows.transpose(1, 2))[:, 0].to(out.dtype)
        offset += width


def packed_lora_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """Training-time LoRA delta of several adapters packed in one batch (autograd-capable).

    Semantics, for ``x: [T, H_in]``, ``lora_a: [P, R, H_in]``, ``lora_b: [P, H_out, R]``, ``scales: [P]``::

        y = zeros(T, H_out)
        for t in range(T):
            p = token_slots[t]
            if p >= 0:
                y[t] = scales[p] * (x[t] @ lora_a[p].T) @ lora_b[p].T
        return y

    Gradients flow to ``x``, ``lora_a`` and ``lora_b`` (rows with slot -1 contribute none to A/B).
    Returns a new tensor ``[T, H_out]`` in ``x``'s dtype; the caller adds it to the base output.
    """
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero(as_tuple=True)[0]
        x_rows = x.index_select(0, rows)
        delta = (x_rows @ lora_a[slot].T) @ lora_b[slot].T * scales[slot]
        out = out.index_add(0, rows, delta.to(out.dtype))
    return out


def paged_view(cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor, used: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logical rows of a paged cache layer as a contiguous ``[N, KV, M * BS, d]`` copy in ``dtype`` (default the
    cache's), block by block: ``out[n, :, p] = cache[block_tables[rows[n], p // BS], :, p % BS]`` for ``cache: [NB,
    KV, BS, d]``, ``block_tables: [R, M]``, ``rows: [N]`` and ``used: [N, M]`` bool; where ``used`` is False the
    table entry is never dereferenced (it may hold anything) and ``out`` holds block 0's values instead."""
    blocks = torch.where(used, block_tables[rows], 0).long()  # [N, M]
    num, per_row = blocks.shape
    kv_heads, block_size, head_dim = cache.shape[1:]
    out = cache.new_empty((num, kv_heads, per_row, block_size, head_dim), dtype=dtype or cache.dtype)
    gathered = cache.index_select(0, blocks.view(-1)).view(num, per_row, kv_heads, block_size, head_dim)
    out.copy_(gathered.permute(0, 2, 1, 3, 4))  # [N, M, KV, BS, d] -> [N, KV, M, BS, d]
    return out.view(num, kv_heads, per_row * block_size, head_dim)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's attention, each row over its own cache row's first ``lengths[b]`` positions, or,
    with ``prefix_rows``/``prefix_lens`` (``[B]`` ints), over row ``prefix_rows[b]``'s K/V at the positions
    below ``prefix_lens[b]`` (a row holding the same prefix K/V: reading one copy for several rows).

    Semantics, for ``q: [B, H, d]``, ``k_cache, v_cache: [S, KV, L, d]`` (``S >= B``), ``lengths: [B]``,
    ``G = H // KV`` query heads per kv head, ``r(b, p) = prefix_rows[b] if p < prefix_lens[b] else b``::

        for b in range(B):
            n = min(lengths[b], L)
            for h in range(H):
                k = stack([k_cache[r(b, p), h // G, p] for p in range(n)])     # [n, d]; v likewise
                out[b, h] = softmax(q[b, h] @ k.T / sqrt(d)) @ v                 # zeros if n <= 0

    Paged (``block_tables: [R, M]`` int32, ``R >= B``; ``k_cache, v_cache: [NB, KV, BS, d]``; ``L = M * BS``):
    the same with ``k_cache[r, :, p]`` read as ``k_cache[block_tables[r, p // BS], :, p % BS]``. The rows are
    taken in groups of equal block counts (``c = cdiv(n, BS)``): a group's blocks are gathered into a contiguous
    ``[rows, KV, c * BS, d]`` (the entries of blocks past ``n``, and of a row's own blocks wholly below its
    prefix, are not dereferenced: they may hold anything), then the slot computation runs on it, so row ``b``
    of a paged call is bit-identical to a slot call of that row alone over its own ``c`` gathered blocks,
    whatever the other rows (gathering and attending over each row's blocks only is what keeps the CPU engine's
    paged decode close to its former slot cost). Reads the lengths on the host.

    Computes in fp32 (an fp8 cache, ``torch.float8_e4m3fn`` with scale 1.0, is dequantised exactly) and writes
    ``out`` (allocated in ``q``'s dtype if not given); returns it. The slot
    layout's positions past a row's length are masked, not skipped, so it reads all ``L`` positions of every
    row, with no host synchronisation.
    """
    if block_tables is not None:
        result = _paged_decode_rows(q, k_cache, v_cache, lengths, prefix_rows, prefix_lens, block_tables)
    else:
        result = _attend_rows(q, *_slot_rows(q.shape[0], k_cache, v_cache, prefix_rows, prefix_lens), lengths)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def _slot_rows(B: int, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_rows: torch.Tensor | None,
               prefix_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention_ref``'s rows of a slot cache as fp32 ``[B, KV, L, d]`` K and V: row ``b``'s own, its
    positions below ``prefix_lens[b]`` from row ``prefix_rows[b]``."""
    if prefix_rows is None:
        return k_cache[:B].float(), v_cache[:B].float()
    L = k_cache.shape[2]
    positions = torch.arange(L, device=k_cache.device)
    source = torch.where(positions[None] < prefix_lens.view(B, 1), prefix_rows.view(B, 1),
                         torch.arange(B, device=k_cache.device)[:, None])
    # [B, L, KV, d] -> [B, KV, L, d], contiguous as the slice above is: the matmuls then take the same kernels, so
    # a row's result does not depend on which row its prefix is read from.
    return (k_cache[source, :, positions].float().permute(0, 2, 1, 3).contiguous(),
            v_cache[source, :, positions].float().permute(0, 2, 1, 3).contiguous())


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``softmax(q @ k.T / sqrt(d)) @ v`` per row and head over each row's first ``lengths[b]`` positions, in fp32:
    ``q: [B, H, d]``, ``k, v: [B, KV, L, d]`` fp32 -> ``[B, H, d]`` (zeros for a row of length 0)."""
    B, H, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    scores = (q.float().view(B, KV, H // KV, D) @ k.transpose(-1, -2)) / D**0.5  # [B, KV, G, L]
    valid = torch.arange(L, device=q.device).view(1, L) < lengths.view(B, 1)  # [B, L]
    scores = scores.masked_fill(~valid.view(B, 1, 1, L), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of length 0 softmaxes to NaN: zeros
    return (probs @ v).view(B, H, D)


def _paged_decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                       prefix_rows: torch.Tensor | None, prefix_lens: torch.Tensor | None,
                       block_tables: torch.Tensor) -> torch.Tensor:
    """``decode_attention_ref``'s fp32 result ``[B, H, d]`` on a paged cache, by groups of rows of equal block
    counts (see its docstring)."""
    block_size, per_row = k_cache.shape[2], block_tables.shape[1]
    lengths = lengths.clamp(0, per_row * block_size)
    counts = torch.div(lengths + block_size - 1, block_size, rounding_mode="floor")
    result = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for count in sorted(set(counts.tolist()) - {0}):
        rows = (counts == count).nonzero(as_tuple=True)[0]
        group_prefix = (None, None) if prefix_rows is None else (prefix_rows[rows], prefix_lens[rows])
        k, v = _gather_decode_rows(k_cache, v_cache, block_tables[:, :count], rows, lengths[rows], *group_prefix)
        result[rows] = _attend_rows(q[rows], k, v, lengths[rows])
    return result


def _gather_decode_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
                        lengths: torch.Tensor, prefix_rows: torch.Tensor | None,
                        prefix_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows ``rows: [N]`` of a paged cache as contiguous fp32 ``[N, KV, M * BS, d]`` K and V (``M``:
    ``block_tables``' width): row ``rows[n]``'s blocks from its own table row, those below ``prefix_lens[n]``
    from table row ``prefix_rows[n]`` (a block holding the prefix's end is read through both, and each position
    taken from its own row's). Only the entries of blocks holding positions a row reads are dereferenced."""
    num = rows.shape[0]
    block_size = k_cache.shape[2]
    starts = torch.arange(block_tables.shape[1], device=k_cache.device)[None] * block_size  # [1, M]: first positions
    lengths = lengths.view(num, 1)
    if prefix_rows is None:
        used = starts < lengths
        return tuple(paged_view(cache, block_tables, rows, used, torch.float32) for cache in (k_cache, v_cache))
    prefix_lens = prefix_lens.view(num, 1)
    prefix_src = torch.where(prefix_lens[:, 0] > 0, prefix_rows, rows)
    used_prefix = starts < torch.minimum(prefix_lens, lengths)
    used_own = (starts < lengths) & (starts + block_size > prefix_lens)
    below = (torch.arange(starts.shape[1] * block_size, device=k_cache.device)[None] < prefix_lens)[:, None, :, None]
    return tuple(
        torch.where(below, paged_view(cache, block_tables, prefix_src, used_prefix),
                    paged_view(cache, block_tables, rows, used_own)).float()
        for cache in (k_cache, v_cache)
    )


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    job_rows: torch.Tensor,
    job_starts: torch.Tensor,
    q_offsets: torch.Tensor,
    q_lens: torch.Tensor,
    scale: float,
    block_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a ragged prefill pass, each job's queries causally over its own cache row.

    Semantics, for ``q: [T, H, d]``, ``k_cache, v_cache: [S, KV, L, d]`` (one layer), ``G = H // KV`` and
    ``[J]`` int64 metadata (a job with ``q_lens[j] <= 0`` is an unused slot)::

        out = zeros(T, H, d)                                             # tokens of no job stay 0
        for j in range(J):
            for i in range(q_lens[j]):
                t, p = q_offsets[j] + i, job_starts[j] + i               # token in q, position in the row
                for h in range(H):
                    k = k_cache[job_rows[j], h // G, :p + 1]               # [p + 1, d]; v likewise
                    out[t, h] = softmax(scale * q[t, h] @ k.T) @ v

    Per job, one ``scaled_dot_product_attention`` in the model dtype over all ``L`` positions of the row
    (masked past each query's position, GQA by ``repeat_interleave``), the queries zero-padded to whole
    :data:`PREFILL_QUERY_QUANTUM` rows: the CPU's flash attention takes another GEMM path for a block of a
    few query rows, so without the padding a query's fp32 bits would depend on its job's length. So a
    job's result depends neither on the other jobs of the pass nor on the pass's shapes (the engine's CPU
    runs are reproducible bit for bit), and equals the runner's former call on chunks padded to whole 16
    positions. With ``scale = 1 / math.sqrt(d)`` this is SDPA's default scale. Reads the metadata on the
    host (``.tolist()``): not capturable in a CUDA graph.

    Paged (``block_tables: [R, M]`` int32; ``k_cache, v_cache: [NB, KV, BS, d]``; ``L = M * BS``): job ``j``
    reads ``k_cache[block_tables[job_rows[j], p // BS], :, p % BS]`` for its position ``p``. Each job's blocks
    are gathered into a contiguous ``[KV, L, d]`` (the entries past its last query's position are not
    dereferenced: they may hold anything), then the slot computation runs on it unchanged, so a paged call is
    bit-identical to a slot call over the gathered cache.

    An fp8 cache (``torch.float8_e4m3fn``, scale 1.0) is dequantised to ``q``'s dtype (exactly) before the SDPA.
    """
    groups = q.shape[1] // k_cache.shape[1]
    L = k_cache.shape[2] if block_tables is None else block_tables.shape[1] * k_cache.shape[2]
    key_positions = torch.arange(L, device=q.device)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    live = (q_lens > 0).nonzero(as_tuple=True)[0]  # unused job slots may name any row
    if block_tables is not None:  # every live job's blocks up to its last position, in one gather: [J', KV, L, d]
        ends = (job_starts + q_lens)[live].view(-1, 1)
        used = torch.arange(block_tables.shape[1], device=q.device)[None] * k_cache.shape[2] < ends
        paged_keys, paged_values = (paged_view(cache, block_tables, job_rows[live], used, q.dtype)
                                    for cache in (k_cache, v_cache))
    jobs = zip(job_rows[live].tolist(), job_starts[live].tolist(), q_offsets[live].tolist(), q_lens[live].tolist())
    for job, (row, start, offset, n) in enumerate(jobs):
        padded = -(-n // PREFILL_QUERY_QUANTUM) * PREFILL_QUERY_QUANTUM
        q_job = torch.nn.functional.pad(q[offset : offset + n], (0, 0, 0, 0, 0, padded - n)).transpose(0, 1)[None]
        if block_tables is None:
            keys, values = k_cache[row][None].to(q.dtype), v_cache[row][None].to(q.dtype)  # [1, KV, L, d]
        else:
            keys, values = paged_keys[job : job + 1], paged_values[job : job + 1]
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        query_positions = start + torch.arange(padded, device=q.device)
        visible = key_positions[None, :] <= query_positions[:, None]  # [padded, L]
        attended = torch.nn.functional.scaled_dot_product_attention(
            q_job, keys, values, attn_mask=visible[None, None], scale=scale
        )  # [1, H, padded, d]
        out[offset : offset + n] = attended[0, :, :n].transpose(0, 1)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x: [N, H]`` after an optional residual add; returns ``(y, h)``, Hugging Face's
    ``LlamaRMSNorm`` / ``Qwen3RMSNorm`` op for op (so the CPU engine matches the trainer's forward)::

        h = x if residual is None else residual + x                     # in x's dtype
        y = weight * (h.float() * rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    """
    h = x if residual is None else residual + x
    h32 = h.to(torch.float32)
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), h


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (if weights are given: Qwen3's ``q_norm``/``k_norm``) then the rotary embedding of
    ``q: [N, Hq, d]`` and ``k: [N, Hk, d]`` with ``cos, sin: [N, d]``; returns new ``(q, k)``, Hugging Face's
    ops in order::

        x = weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(dtype)   # if weights
        x = x * cos[:, None] + cat(-x[..., d/2:], x[..., :d/2]) * sin[:, None]
    """
    def one(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is not None:
            x, _ = rms_norm_ref(x, weight, eps)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos[:, None]) + (rotated * sin[:, None])

    return one(q, q_weight), one(k, k_weight)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the SwiGLU MLP's activation), in the inputs' dtype."""
    return torch.nn.functional.silu(gate) * up


def chosen_logprobs_ref(logits: torch.Tensor, targets: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """``[N]`` float32 ``log_softmax(logits.float())[n, targets[n]]`` for ``logits: [N, V]``; with ``write_grad``
    overwrites ``logits`` with ``onehot(targets) - softmax(logits.float())`` (each row's log-prob's gradient
    with respect to its logits, rounded to ``logits``' dtype)."""
    values = logits.float()
    out = values.gather(1, targets[:, None])[:, 0] - torch.logsumexp(values, dim=-1)
    if write_grad:
        grad = torch.softmax(values, dim=-1).neg_()
        grad.scatter_add_(1, targets[:, None], torch.ones_like(grad[:, :1]))
        logits.copy_(grad)
    return out


def sample_tokens_ref(logits: torch.Tensor, temperature: torch.Tensor,
                      uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy or inverse-CDF sampling of one token per row of ``logits: [N, V]`` (any float dtype, computed
    in fp32) with ``temperature, uniform: [N]`` float32; returns ``(tokens [N] int64, logprobs [N] float32)``::

        p = softmax(logits / temperature)                               # temperature clamped to 1e-6
        token = argmax(logits) if temperature == 0 else inverse_cdf_ref(p, uniform)
        logprob = logits[token] - logsumexp(logits)                     # untempered

    The sampler's CPU path, whose draws the engine's tests compare bit for bit. No host synchronisation.
    """
    logits = logits.float()
    probs = torch.softmax(logits / temperature.clamp(min=MIN_TEMPERATURE)[:, None], dim=-1)
    tokens = torch.where(temperature == 0.0, logits.argmax(dim=-1), inverse_cdf_ref(probs, uniform))
    return tokens, logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def inverse_cdf_ref(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """``[N, V]`` probabilities (each row with positive mass), ``[N]`` uniforms -> ``[N]`` token ids (int64):
    the first index whose cumulative probability exceeds ``u * sum(p)``, found in two levels (blocks of
    :data:`CDF_BLOCK` tokens, then inside the chosen block: a scan over the whole vocabulary was the
    slowest kernel of a GPU decode step); where rounding puts the target past a row's mass, the last token
    of positive probability."""
    num, vocab = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -vocab % CDF_BLOCK)).view(num, -1, CDF_BLOCK)  # [N, nb, B]
    block_mass = blocks.sum(-1)  # [N, nb]
    block_cdf = block_mass.cumsum(-1)
    target = uniform * block_cdf[:, -1]  # [N]
    block_ids = torch.arange(block_mass.shape[1], device=probs.device)
    last_block = torch.where(block_mass > 0, block_ids, 0).amax(-1, keepdim=True)  # [N, 1]
    block = torch.searchsorted(block_cdf, target[:, None], right=True).clamp(max=last_block)  # [N, 1]
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK))[:, 0]  # [N, B]
    before = (block_cdf.gather(1, block) - block_mass.gather(1, block))[:, 0]  # mass ahead of the block
    offset = torch.searchsorted(inside.cumsum(-1), (target - before)[:, None], right=True)  # [N, 1]
    token_ids = torch.arange(CDF_BLOCK, device=probs.device)
    last_token = torch.where(inside > 0, token_ids, 0).amax(-1, keepdim=True)
    return (block * CDF_BLOCK + offset.clamp(max=last_token))[:, 0]
