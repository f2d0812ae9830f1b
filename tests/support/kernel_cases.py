"""Random multi-LoRA problems over adapter layouts for the parity tests (CPU and GPU); random decode-attention,
prefill-attention and token-sampling problems with their float64 checks.

Layouts follow punica's sweep of adapter popularity: every row its own adapter in turn (``distinct``),
``uniform``, ``zipf``, all rows one adapter (``identical``), 90% on one adapter (``skewed``), and a third
of the rows with no adapter (``no_adapter``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch

from skyrl_clora.kernels.lora.folded import FoldedWeights, fold_lora_weights
from skyrl_clora.kernels.reference import add_lora_ref, decode_attention_ref, prefill_attention_ref, qk_norm_rope_ref

LAYOUTS = ("distinct", "uniform", "zipf", "identical", "skewed", "no_adapter")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the model dtypes the kernel parity tests sweep
# Largest relative error ||got - ref|| / ||ref - out_before|| accepted against the fp32 reference:
# fp32 (ieee dots) is near rounding; fp16/bf16 round the input, h and the output to 10/7 mantissa bits.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


Result = TypeVar("Result")


def capture_graph(step: Callable[[], Result]) -> tuple[torch.cuda.CUDAGraph, Result, int]:
    """Runs ``step`` once on a side stream (compiling and warming up outside the capture), then captures it in a
    CUDA graph; returns the graph, what the captured call returned, and the bytes it allocated in the capture
    (after capture_begin's own bookkeeping tensors)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        allocated = torch.cuda.memory_allocated()
        result = step()
        step_allocated = torch.cuda.memory_allocated() - allocated
    return graph, result, step_allocated


def make_slots(layout: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """``token_slots: [num_tokens]`` int64 on the CPU, drawn for ``layout`` (one of ``LAYOUTS``)."""
    T, S = num_tokens, num_slots
    if layout == "distinct":
        slots = torch.arange(T) % S
        return slots[torch.randperm(T, generator=gen)]
    if layout == "uniform":
        return torch.randint(0, S, (T,), generator=gen)
    if layout == "zipf":
        weights = 1.0 / torch.arange(1, S + 1, dtype=torch.float64) ** 1.2
        return torch.multinomial(weights, T, replacement=True, generator=gen)
    if layout == "identical":
        return torch.full((T,), S - 1, dtype=torch.int64)
    if layout == "skewed":
        slots = torch.zeros(T, dtype=torch.int64)
        others = torch.rand(T, generator=gen) < 0.1
        slots[others] = torch.randint(1, S, (int(others.sum()),), generator=gen)
        return slots
    if layout == "no_adapter":
        return torch.randint(-1, S, (T,), generator=gen).where(torch.rand(T, generator=gen) > 0.33, -1)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


@dataclass
class LoRAProblem:
    """Inputs of one ``add_lora`` call (see ``reference.add_lora_ref`` for the shapes)."""

    out: torch.Tensor
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: tuple[torch.Tensor, ...]
    scales: torch.Tensor
    token_slots: torch.Tensor


def make_problem(
    num_tokens: int,
    h_in: int,
    widths: tuple[int, ...],
    num_slots: int,
    rank: int,
    dtype: torch.dtype,
    layout: str,
    per_slice_a: bool = False,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> LoRAProblem:
    """A random problem whose deltas are of the order of ``out`` (so output rounding does not hide errors).

    Slots get mixed true ranks in ``[max(1, rank // 2), rank]``, zero-padded to ``rank``.
    """
    gen = torch.Generator().manual_seed(seed)
    n_a = len(widths) if per_slice_a else 1
    a = torch.randn(n_a, num_slots, rank, h_in, generator=gen) / h_in**0.5
    b = [torch.randn(num_slots, w, rank, generator=gen) / rank**0.5 for w in widths]
    true_ranks = torch.randint(max(1, rank // 2), rank + 1, (num_slots,), generator=gen)
    for s, r in enumerate(true_ranks.tolist()):
        a[:, s, r:] = 0
        for bi in b:
            bi[s, :, r:] = 0
    scales = 0.5 + 1.5 * torch.rand(num_slots, generator=gen)
    x = torch.randn(num_tokens, h_in, generator=gen)
    out = torch.randn(num_tokens, sum(widths), generator=gen)
    slots = make_slots(layout, num_tokens, num_slots, gen)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

    return LoRAProblem(
        out=dev(out),
        x=dev(x),
        lora_a=dev(a if per_slice_a else a[0]),
        lora_b=tuple(dev(bi) for bi in b),
        scales=scales.to(device),
        token_slots=slots.to(device),
    )


def reference_out(p: LoRAProblem) -> torch.Tensor:
    """``out`` after ``add_lora``, computed in fp32 from the (rounded) inputs."""
    ref = p.out.float().clone()
    add_lora_ref(ref, p.x.float(), p.lora_a.float(), tuple(b.float() for b in p.lora_b), p.scales, p.token_slots)
    return ref


def rel_error(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> float:
    """``||got - want|| / ||want - before||``: the error relative to the size of the update."""
    got, want, before = got.double(), want.double(), before.double()
    return ((got - want).norm() / (want - before).norm().clamp_min(1e-30)).item()


def fold_problem(p: LoRAProblem, with_bias: bool, seed: int = 0) -> FoldedWeights:
    """A random base layer for ``p`` with its slots' A folded below the weight (``kernels.lora.folded``); ``p.out``
    becomes the base layer's output ``x @ W.T + bias`` (of the order of the deltas, like ``make_problem``'s)."""
    gen = torch.Generator().manual_seed(seed)
    h_in, width = p.x.shape[1], p.out.shape[1]
    weight = (torch.randn(width, h_in, generator=gen) / h_in**0.5).to(p.x.device, p.x.dtype)
    bias = torch.randn(width, generator=gen).to(p.x.device, p.x.dtype) if with_bias else None
    lora_a = p.lora_a if p.lora_a.dim() == 4 else p.lora_a.unsqueeze(0)  # one A shared by every slice
    p.out = torch.nn.functional.linear(p.x, weight, bias)
    return fold_lora_weights(weight, bias, lora_a)


def adapters_differ(p: LoRAProblem) -> bool:
    """True if the batch mixes at least two adapters and every two of them give different deltas.

    Each active adapter is applied alone to every row (fp32 reference); a mixed-batch parity test that
    asserts this first cannot pass because the adapters happen to be equal.
    """
    active = sorted(s for s in p.token_slots.unique().tolist() if s >= 0)
    if len(active) < 2:
        return False
    deltas = []
    for s in active:
        q = LoRAProblem(p.out.float() * 0, p.x, p.lora_a, p.lora_b, p.scales, torch.full_like(p.token_slots, s))
        deltas.append(reference_out(q))
    return all(
        not torch.allclose(deltas[i], deltas[j], rtol=1e-3, atol=1e-3)
        for i in range(len(deltas))
        for j in range(i + 1, len(deltas))
    )


@dataclass
class QKVRopeProblem:
    """A folded q/k/v layer (``lora.out`` its base output) and the norm + rotary inputs of ``folded_qkv_rope``."""

    lora: LoRAProblem
    folded: FoldedWeights
    head_dim: int
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float = 1e-6


def make_qkv_rope_problem(num_tokens: int, h_in: int, heads_q: int, heads_kv: int, head_dim: int, num_slots: int,
                          rank: int, dtype: torch.dtype, layout: str, with_norm: bool,
                          device: torch.device | str = "cpu", seed: int = 0) -> QKVRopeProblem:
    """``make_problem`` with q/k/v slices of whole heads (one A per slice) and a biased base layer folded
    (``fold_problem``), rotary tables at random positions, and per-head norm weights if ``with_norm``."""
    widths = (heads_q * head_dim, heads_kv * head_dim, heads_kv * head_dim)
    lora = make_problem(num_tokens, h_in, widths, num_slots, rank, dtype, layout, per_slice_a=True, device=device,
                        seed=seed)
    folded = fold_problem(lora, with_bias=True, seed=seed)
    lora.lora_a = folded.lora_a
    gen = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).double()
    inv_freq = 1e6 ** (-torch.arange(0, head_dim, 2).double() / head_dim)
    angles = (positions[:, None] * inv_freq[None, :]).repeat(1, 2)
    norms = [(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device, dtype) if with_norm else None for _ in range(2)]
    return QKVRopeProblem(lora, folded, head_dim, angles.cos().to(device, dtype), angles.sin().to(device, dtype), *norms)


def qkv_rope_ref_fp32(p: QKVRopeProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``folded_qkv_rope``'s q, k, v computed in fp32 from the (rounded) inputs."""
    y = reference_out(p.lora)
    q, k, v = (t.reshape(y.shape[0], -1, p.head_dim) for t in y.split([b.shape[1] for b in p.lora.lora_b], dim=-1))
    weights = [None if w is None else w.float() for w in (p.q_weight, p.k_weight)]
    q, k = qk_norm_rope_ref(q, k, p.cos.float(), p.sin.float(), *weights, p.eps)
    return q, k, v


def check_kv_cache_write(p: QKVRopeProblem, cache_rows: int, cache_len: int, backend: str | None = None,
                         cache_dtype: torch.dtype | None = None) -> None:
    """``folded_qkv_rope_into_cache`` on ``p`` into a random ``[cache_rows, KV, cache_len, d]`` cache (in
    ``cache_dtype``, None: the model's), each token at a distinct random (row, position): its q is
    ``folded_qkv_rope``'s, each token's cache entry holds that call's k and v cast to the cache dtype bit for
    bit, and every other entry is as it was."""
    from skyrl_clora.kernels import KVCacheWrite, folded_qkv_rope, folded_qkv_rope_into_cache

    lora = p.lora
    args = (lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, p.head_dim, p.cos, p.sin, p.q_weight,
            p.k_weight, p.eps)
    q, k, v = folded_qkv_rope(*args, backend=backend)
    gen = torch.Generator().manual_seed(cache_rows)
    shape = (cache_rows, k.shape[1], cache_len, p.head_dim)
    dtype = cache_dtype or k.dtype
    before_k, before_v = (torch.randn(shape, generator=gen).to(k.device, dtype) for _ in range(2))
    entries = torch.randperm(cache_rows * cache_len, generator=gen)[: q.shape[0]].to(k.device)
    rows, positions = entries // cache_len, entries % cache_len
    cache = KVCacheWrite(before_k.clone(), before_v.clone(), rows, positions)
    got_q = folded_qkv_rope_into_cache(*args, cache, backend=backend)
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[rows, :, positions] = k.to(dtype)
    want_v[rows, :, positions] = v.to(dtype)
    # As fp32 values (torch.equal has no fp8 kernel on the CPU): equal bits but for the sign of a zero, which the
    # Triton interpreter's fp8 conversion drops.
    assert not torch.equal(want_k.float(), before_k.float()) and not torch.equal(want_k[rows].float(), want_v[rows].float()), \
        "vacuous cache check"
    assert torch.equal(got_q, q)
    assert torch.equal(cache.k_cache.float(), want_k.float()) and torch.equal(cache.v_cache.float(), want_v.float())


@dataclass
class AttentionProblem:
    """Inputs of one ``decode_attention`` call (see ``reference.decode_attention_ref`` for the shapes)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    lengths: torch.Tensor


def make_attention_problem(
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    max_len: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_rows: int | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    poison: bool = False,
    lengths: list[int] | None = None,
    cache_values: torch.dtype | None = None,
) -> AttentionProblem:
    """Random q and caches; ``lengths`` as given, else drawn in ``[1, max_len]`` with the first row at 1 and
    the second at ``max_len`` (when there are two rows). Keys are scaled so the softmax is neither flat nor
    one-hot.

    ``poison``: cache positions past each row's length, and cache rows past ``num_rows``, hold NaN (a
    kernel that reads them returns NaN; the reference must then be given the clean caches).

    ``cache_values``: the caches' values are rounded through that dtype (e.g. ``FP8``), so the caches cast to it
    are exact: a kernel on the cast caches is checked against the references on the problem's own.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    S = cache_rows or num_rows
    q = torch.randn(num_rows, num_heads, head_dim, generator=gen, device=device)
    k = torch.randn(S, num_kv_heads, max_len, head_dim, generator=gen, device=device) * 1.5
    v = torch.randn(S, num_kv_heads, max_len, head_dim, generator=gen, device=device)
    if lengths is None:
        drawn = torch.randint(1, max_len + 1, (num_rows,), generator=gen, device=device)
        drawn[0] = 1
        if num_rows > 1:
            drawn[1] = max_len
    else:
        drawn = torch.tensor(lengths, dtype=torch.int64, device=device)
    if poison:
        past = torch.arange(max_len, device=device).view(1, 1, max_len, 1) >= drawn.view(-1, 1, 1, 1)
        k[:num_rows].masked_fill_(past, float("nan"))
        v[:num_rows].masked_fill_(past, float("nan"))
        k[num_rows:] = float("nan")
        v[num_rows:] = float("nan")
    k, v = rounded_through(k, cache_values), rounded_through(v, cache_values)
    return AttentionProblem(q=q.to(dtype), k_cache=k.to(dtype), v_cache=v.to(dtype), lengths=drawn)


FP8 = torch.float8_e4m3fn  # the K/V cache's fp8 dtype (scale 1.0)
CACHE_DTYPES = [pytest.param(None, id="model-cache"), pytest.param(FP8, id="fp8-cache")]
"""The attention tests' cache dtypes: the model's (None) or fp8."""


def rounded_through(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` (fp32) with its values rounded to ``dtype`` and back (unchanged for None)."""
    return t if dtype is None else t.to(dtype).to(t.dtype)


def as_cache(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A cache tensor in ``dtype`` (None: as it is)."""
    return t if dtype is None else t.to(dtype)


def attention_loop_ref(p: AttentionProblem) -> torch.Tensor:
    """``decode_attention``'s semantics as a plain loop over rows and heads in float64 (``[B, H, d]``); reads
    only each row's first ``lengths[b]`` positions."""
    B, H, D = p.q.shape
    group = H // p.k_cache.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(p.lengths[b])
        for h in range(H):
            k = p.k_cache[b, h // group, :n].double().cpu()
            v = p.v_cache[b, h // group, :n].double().cpu()
            out[b, h] = torch.softmax(p.q[b, h].double().cpu() @ k.T / D**0.5, dim=0) @ v
    return out


def attention_ref_fp32(p: AttentionProblem) -> torch.Tensor:
    """``decode_attention_ref`` in fp32 on the problem's (rounded) inputs, poison replaced by zeros (the
    reference masks positions past the length but still multiplies their V by a zero weight)."""
    return decode_attention_ref(
        p.q.float(), p.k_cache.float().nan_to_num(0.0), p.v_cache.float().nan_to_num(0.0), p.lengths
    )


@dataclass
class PrefillProblem:
    """Inputs of one ``prefill_attention`` call (see ``reference.prefill_attention_ref`` for the shapes)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    job_rows: torch.Tensor
    job_starts: torch.Tensor
    q_offsets: torch.Tensor
    q_lens: torch.Tensor
    scale: float

    def args(self) -> tuple:
        """The positional arguments of ``prefill_attention``."""
        return (self.q, self.k_cache, self.v_cache, self.job_rows, self.job_starts, self.q_offsets, self.q_lens, self.scale)


def make_prefill_problem(
    jobs: Sequence[tuple[int, int, int]],
    num_heads: int,
    num_kv_heads: int,
    max_len: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_rows: int,
    device: torch.device | str = "cpu",
    seed: int = 0,
    poison: bool = False,
    cache_values: torch.dtype | None = None,
) -> PrefillProblem:
    """A ragged pass of ``jobs``, ``(row, start, q_len)`` per job slot (``q_len`` 0: an unused slot at offset
    0). The jobs' tokens are laid out in ``q`` in a shuffled order with 1 or 2 tokens of no job before each
    job and after the last, so ``q_offsets`` are neither sorted nor contiguous. Keys are scaled so the
    softmax is neither flat nor one-hot; ``scale = 1 / sqrt(d)``.

    ``poison``: each row's cache positions past its jobs' last position, the rows of no job and ``q``'s
    tokens of no job hold NaN (a kernel that reads them returns NaN; the torch reference, which reads every
    position, must then be given the clean tensors: ``prefill_ref_fp32``). ``cache_values`` as for
    :func:`make_attention_problem`.
    """
    order = random.Random(seed)
    offsets, token = [0] * len(jobs), 0
    for j in order.sample(range(len(jobs)), len(jobs)):
        if jobs[j][2] > 0:
            token += order.randint(1, 2)
            offsets[j], token = token, token + jobs[j][2]
    num_tokens = token + order.randint(1, 2)
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device)
    k = torch.randn(cache_rows, num_kv_heads, max_len, head_dim, generator=gen, device=device) * 1.5
    v = torch.randn(cache_rows, num_kv_heads, max_len, head_dim, generator=gen, device=device)
    if poison:
        ends = [0] * cache_rows
        covered = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        for (row, start, n), offset in zip(jobs, offsets):
            if n > 0:
                ends[row] = max(ends[row], start + n)
                covered[offset : offset + n] = True
        past = torch.arange(max_len, device=device)[None, :] >= torch.tensor(ends, device=device)[:, None]  # [S, L]
        k.masked_fill_(past[:, None, :, None], float("nan"))
        v.masked_fill_(past[:, None, :, None], float("nan"))
        q[~covered] = float("nan")
    k, v = rounded_through(k, cache_values), rounded_through(v, cache_values)
    rows, starts, lens = (torch.tensor([job[i] for job in jobs], dtype=torch.int64, device=device) for i in range(3))
    return PrefillProblem(q.to(dtype), k.to(dtype), v.to(dtype), rows, starts,
                          torch.tensor(offsets, dtype=torch.int64, device=device), lens, 1 / math.sqrt(head_dim))


def prefill_loop_ref(p: PrefillProblem) -> torch.Tensor:
    """``prefill_attention``'s semantics as a plain loop over the jobs' queries in float64 (``[T, H, d]`` on the
    CPU, zeros for tokens of no job); reads only the keys each query sees."""
    T, H, D = p.q.shape
    group = H // p.k_cache.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    metadata = (p.job_rows.tolist(), p.job_starts.tolist(), p.q_offsets.tolist(), p.q_lens.tolist())
    for row, start, offset, n in zip(*metadata):
        for i in range(n):
            keys = p.k_cache[row, :, : start + i + 1].double().cpu().repeat_interleave(group, 0)  # [H, p + 1, d]
            values = p.v_cache[row, :, : start + i + 1].double().cpu().repeat_interleave(group, 0)
            weights = torch.softmax(torch.einsum("hd,hkd->hk", p.q[offset + i].double().cpu(), keys) * p.scale, dim=-1)
            out[offset + i] = torch.einsum("hk,hkd->hd", weights, values)
    return out


def prefill_ref_fp32(p: PrefillProblem) -> torch.Tensor:
    """``prefill_attention_ref`` in fp32 on the problem's (rounded) inputs, poison replaced by zeros (the
    reference masks the positions past each query but still reads them)."""
    return prefill_attention_ref(p.q.float().nan_to_num(0.0), p.k_cache.float().nan_to_num(0.0),
                                 p.v_cache.float().nan_to_num(0.0), *p.args()[3:])


@dataclass
class SamplingProblem:
    """Inputs of one ``sample_tokens`` call (see ``reference.sample_tokens_ref`` for the shapes)."""

    logits: torch.Tensor
    temperature: torch.Tensor
    uniform: torch.Tensor


SAMPLING_TEMPERATURES = (0.6, 1.0, 0.0)  # row i draws at SAMPLING_TEMPERATURES[i % 3]


def make_sampling_problem(num_rows: int, vocab: int, dtype: torch.dtype = torch.float32,
                          device: torch.device | str = "cpu", seed: int = 0) -> SamplingProblem:
    """Random logits ``[num_rows, vocab]`` with rows of four kinds in turn (row ``i`` of kind ``i % 4``):
    spread (``randn * 3``), peaked (one token 12 ahead), flat (``randn * 0.01``), sparse (``-inf`` but 8
    tokens in the first two thirds of the vocabulary); temperatures ``SAMPLING_TEMPERATURES[i % 3]``, so every
    kind is drawn greedily and at both temperatures over 12 rows. Row 2 (greedy) has its maximum at three
    tokens, the first at ``vocab // 3 - 1``; row 3 (sparse) draws with ``u = 1.0`` (its target is the row's
    total mass: the last token of positive probability, followed by a third of the vocabulary at ``-inf``).
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen, dtype=torch.float64)
    for row in range(num_rows):
        kind = row % 4
        if kind == 0:
            logits[row] *= 3.0
        elif kind == 1:
            logits[row, int(torch.randint(vocab, (1,), generator=gen))] += 12.0
        elif kind == 2:
            logits[row] *= 0.01
        else:
            kept = torch.randperm(2 * vocab // 3, generator=gen)[:8]
            logits[row] = float("-inf")
            logits[row, kept] = torch.randn(8, generator=gen, dtype=torch.float64) * 2
    if num_rows > 2:
        logits[2, [vocab // 3 - 1, vocab // 3 + 5, vocab - 2]] = logits[2].max() + 1.0
    temperature = torch.tensor([SAMPLING_TEMPERATURES[i % 3] for i in range(num_rows)])
    uniform = torch.rand(num_rows, generator=gen)
    if num_rows > 3:
        uniform[3] = 1.0
    return SamplingProblem(logits.to(dtype).to(device), temperature.to(device), uniform.to(device))


def check_samples(p: SamplingProblem, tokens: torch.Tensor, logprobs: torch.Tensor, tol: float = 1e-5) -> torch.Tensor:
    """Asserts ``sample_tokens``' semantics in float64 for every row and returns the ``[N]`` bool mask of the
    sampled rows whose target ``u * total`` lies farther than ``tol * total`` from every cumulative sum (there
    any implementation must draw the same token; elsewhere rounding decides).

    Greedy rows: the first maximum. Sampled rows: a token of positive probability whose cumulative
    interval ``[cdf(token) - p(token), cdf(token)]`` holds the target within ``tol * total``. Every row: the
    log-probability ``logits[token] - logsumexp(logits)`` within ``tol``.
    """
    logits, tokens, logprobs = p.logits.double(), tokens.to(p.logits.device), logprobs.double().to(p.logits.device)
    temperature, uniform = p.temperature.double(), p.uniform.float().double()
    greedy = temperature == 0.0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1)), "a greedy row missed its first maximum"
    probs = torch.softmax(logits / temperature.clamp(min=1e-6)[:, None], dim=-1)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = uniform[:, None] * total
    chosen_p = probs.gather(1, tokens[:, None])
    after = cdf.gather(1, tokens[:, None])
    sampled = ~greedy
    assert bool((chosen_p[sampled] > 0).all()), "a token of probability 0 was drawn"
    inside = (after - chosen_p - tol * total <= target) & (target <= after + tol * total)
    outside = (~inside[:, 0] & sampled).nonzero()[:, 0].tolist()
    assert not outside, f"targets outside their tokens' intervals in rows {outside}"
    want = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    assert torch.allclose(logprobs, want, rtol=0.0, atol=tol), f"log-probability error {(logprobs - want).abs().max():.2e}"
    return sampled & ((cdf - target).abs() > tol * total).all(-1)
