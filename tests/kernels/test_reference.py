"""Tests of ``kernels.reference`` (the pure-torch references: the CPU path, and the semantics every kernel is checked
against) against naive loops on small random inputs: ``add_lora_ref`` (one A, or one A per slice; rows with no
adapter left bit for bit; a row's bits independent of the batch), ``packed_lora_ref``'s values and gradients,
``paged_view``, ``rms_norm_ref``, ``qk_norm_rope_ref``, ``silu_mul_ref``, ``chosen_logprobs_ref`` (with the gradient
written over the logits), ``inverse_cdf_ref`` and ``sample_tokens_ref``, and the sampler's semantics in float64. The
attention references are tested in test_reference_decode_attention.py and test_reference_prefill_attention.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_clora.kernels import sample_tokens
from skyrl_clora.kernels.reference import (
    CDF_BLOCK,
    add_lora_ref,
    chosen_logprobs_ref,
    inverse_cdf_ref,
    packed_lora_ref,
    paged_view,
    qk_norm_rope_ref,
    rms_norm_ref,
    sample_tokens_ref,
    silu_mul_ref,
)
from tests.support.kernel_cases import check_samples, make_sampling_problem
from tests.support.layer_checks import SAMPLING_VOCAB as VOCAB

SLOTS = [0, 2, -1, 1, 2, -1, 0]  # the LoRA references' rows: three slots, two rows with no adapter


def test_reference_follows_the_semantics() -> None:
    p = make_sampling_problem(12, VOCAB, seed=1)
    tokens, logprobs = sample_tokens(p.logits, p.temperature, p.uniform)
    assert len(set(tokens.tolist())) >= 11, "rows must draw different tokens"
    assert int(check_samples(p, tokens, logprobs).sum()) >= 4


@pytest.mark.parametrize("per_slice_a", [False, True], ids=["shared-a", "a-per-slice"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_lora_ref_matches_a_loop(dtype: torch.dtype, per_slice_a: bool) -> None:
    """Each row with a slot gets ``scales[s] * (x @ A_i[s].T) @ B_i[s].T`` added to its slice ``i`` (in fp32, added
    in ``out``'s dtype); rows with no adapter keep their bits; a row's result is the same bits in a smaller batch."""
    gen = torch.Generator().manual_seed(0)
    lora_a = torch.randn(2, 3, 4, 12, generator=gen).to(dtype)  # [slices, S, R, H_in]
    lora_a = lora_a if per_slice_a else lora_a[0]
    lora_b = (torch.randn(3, 5, 4, generator=gen).to(dtype), torch.randn(3, 3, 4, generator=gen).to(dtype))
    scales = torch.tensor([0.5, 2.0, 1.5])
    x = torch.randn(len(SLOTS), 12, generator=gen).to(dtype)
    out = torch.randn(len(SLOTS), 8, generator=gen).to(dtype)
    before = out.clone()
    add_lora_ref(out, x, lora_a, lora_b, scales, torch.tensor(SLOTS))
    want = before.double()
    for t, s in enumerate(SLOTS):
        offset = 0
        for i, b in enumerate(lora_b):
            a = lora_a[i] if per_slice_a else lora_a
            if s >= 0:
                want[t, offset : offset + b.shape[1]] += float(scales[s]) * (x[t].double() @ a[s].double().T) @ b[s].double().T
            offset += b.shape[1]
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    torch.testing.assert_close(out.double(), want, **tolerance)
    no_adapter = torch.tensor(SLOTS) < 0
    assert torch.equal(out[no_adapter], before[no_adapter])
    part = before[1:4].clone()
    add_lora_ref(part, x[1:4], lora_a, lora_b, scales, torch.tensor(SLOTS[1:4]))
    assert torch.equal(part, out[1:4])


def test_packed_lora_ref_values_and_gradients_match_a_loop() -> None:
    """``y[t] = scales[p] * (x[t] @ A[p].T) @ B[p].T`` (zero for rows with no slot) and its gradients in x, A and B:
    zero for a slot with no rows."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([1, -1, 0, 1, 0, -1])  # slot 2 has no rows
    scales = torch.tensor([0.5, 2.0, 1.5])
    inputs = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((6, 5), (3, 2, 5), (3, 4, 2))]
    dy = torch.randn(6, 4, generator=gen, dtype=torch.float64)

    def loop(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = [float(scales[p]) * (x[t] @ a[p].T) @ b[p].T if p >= 0 else x.new_zeros(4)
                for t, p in enumerate(slots.tolist())]
        return torch.stack(rows)

    results = []
    for fn in (lambda x, a, b: packed_lora_ref(x, a, b, scales, slots), loop):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        y = fn(*leaves)
        y.backward(dy)
        results.append([y.detach()] + [leaf.grad for leaf in leaves])
    for name, got, want in zip(("y", "dx", "dA", "dB"), *results):
        torch.testing.assert_close(got, want, msg=name)
    y, _, da, db = results[0]
    assert not y[slots < 0].any() and not da[2].any() and not db[2].any()
    assert da[0].abs().sum() > 0 and db[1].abs().sum() > 0


def test_paged_view_reads_each_position_from_its_block() -> None:
    """``out[n, :, p] = cache[block_tables[rows[n], p // BS], :, p % BS]`` where the entry is used, block 0's values
    where it is not (the entry, here garbage, is never dereferenced); a contiguous copy in the dtype asked for."""
    cache = torch.randn(5, 2, 3, 4, generator=torch.Generator().manual_seed(2))  # 5 blocks of 3 positions
    tables = torch.tensor([[4, 1, 99], [2, 0, -7]], dtype=torch.int32)
    rows = torch.tensor([1, 0, 1])
    used = torch.tensor([[True, True, False], [True, True, False], [True, False, False]])
    got = paged_view(cache, tables, rows, used, torch.float64)
    assert got.shape == (3, 2, 9, 4) and got.dtype == torch.float64 and got.is_contiguous()
    for n in range(3):
        for p in range(9):
            block = int(tables[rows[n], p // 3]) if used[n, p // 3] else 0
            assert torch.equal(got[n, :, p], cache[block, :, p % 3].double()), (n, p)
    assert paged_view(cache, tables, rows, used).dtype == torch.float32


@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_ref_matches_a_loop(dtype: torch.dtype, with_residual: bool) -> None:
    """``h = x`` (itself) or ``residual + x``, and ``y = weight * h / sqrt(mean(h ** 2) + eps)`` per row."""
    gen = torch.Generator().manual_seed(3)
    x = (2 * torch.randn(4, 6, generator=gen)).to(dtype)
    residual = torch.randn(4, 6, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.3 * torch.randn(6, generator=gen)).to(dtype)
    y, h = rms_norm_ref(x, weight, 1e-5, residual)
    if residual is None:
        assert h is x
    else:
        assert torch.equal(h, residual + x)
    assert y.dtype == dtype and y.shape == (4, 6)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for n in range(4):
        row = h[n].double().tolist()
        rms = math.sqrt(sum(v * v for v in row) / 6 + 1e-5)
        want = torch.tensor([float(weight[i]) * row[i] / rms for i in range(6)], dtype=torch.float64)
        torch.testing.assert_close(y[n].double(), want, **tolerance)


@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "norm-rope"])
def test_qk_norm_rope_ref_matches_a_loop(with_norm: bool) -> None:
    """Per (token, head): the RMSNorm with the head's weight (if any), then ``x[i] * cos[i] + r[i] * sin[i]`` with
    ``r = (-x[d/2:], x[:d/2])``; q and k each with their own weight."""
    gen = torch.Generator().manual_seed(4)
    num, dim, eps = 3, 8, 1e-6
    q, k = torch.randn(num, 2, dim, generator=gen), torch.randn(num, 1, dim, generator=gen)
    cos, sin = torch.randn(num, dim, generator=gen), torch.randn(num, dim, generator=gen)
    weights = [1 + 0.3 * torch.randn(dim, generator=gen) for _ in range(2)] if with_norm else [None, None]
    got = qk_norm_rope_ref(q, k, cos, sin, *weights, eps)
    for x, weight, out in zip((q, k), weights, got):
        assert out.shape == x.shape
        for n in range(num):
            for h in range(x.shape[1]):
                v = x[n, h].double().tolist()
                if weight is not None:
                    rms = math.sqrt(sum(e * e for e in v) / dim + eps)
                    v = [float(weight[i]) * v[i] / rms for i in range(dim)]
                rotated = [-v[i + dim // 2] if i < dim // 2 else v[i - dim // 2] for i in range(dim)]
                want = [v[i] * float(cos[n, i]) + rotated[i] * float(sin[n, i]) for i in range(dim)]
                torch.testing.assert_close(out[n, h].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5,
                                           atol=1e-6)


def test_silu_mul_ref_matches_a_loop() -> None:
    gen = torch.Generator().manual_seed(5)
    gate, up = 3 * torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    got = silu_mul_ref(gate, up)
    want = [[g / (1 + math.exp(-g)) * u for g, u in zip(gs, us)] for gs, us in zip(gate.tolist(), up.tolist())]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert silu_mul_ref(gate.bfloat16(), up.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("write_grad", [False, True], ids=["values", "values-and-grad"])
def test_chosen_logprobs_ref_matches_a_loop(write_grad: bool) -> None:
    """``logits[n, t] - logsumexp(logits[n])`` as float32; with ``write_grad`` the logits become ``onehot(t) -
    softmax(logits)``, else they are left as they were."""
    logits = 3 * torch.randn(3, 7, generator=torch.Generator().manual_seed(6))
    targets = torch.tensor([6, 0, 3])
    original = logits.clone()
    out = chosen_logprobs_ref(logits, targets, write_grad)
    assert out.dtype == torch.float32 and out.shape == (3,)
    for n, t in enumerate(targets.tolist()):
        row = original[n].double().tolist()
        top = max(row)
        lse = top + math.log(sum(math.exp(v - top) for v in row))
        assert abs(float(out[n]) - (row[t] - lse)) < 1e-5
        if write_grad:
            want = torch.tensor([float(v == t) - math.exp(row[v] - lse) for v in range(7)], dtype=torch.float64)
            torch.testing.assert_close(logits[n].double(), want, rtol=1e-5, atol=1e-6)
    if not write_grad:
        assert torch.equal(logits, original)


def _first_past(masses: list[float], target: float) -> int:
    """The first index whose cumulative mass exceeds ``target``, else the last index of positive mass."""
    total = 0.0
    for index, mass in enumerate(masses):
        total += mass
        if total > target:
            return index
    return max(index for index, mass in enumerate(masses) if mass > 0)


def test_inverse_cdf_ref_matches_a_loop() -> None:
    """Integer masses (exact sums in fp32) over two and a half CDF blocks: every mass, the mass in one block (the
    middle one, or the last, partial one), a tail of zeros drawn at ``u = 1`` (its last token of positive mass), one
    token; ``u = 0`` draws the first token of positive mass."""
    gen = torch.Generator().manual_seed(7)
    vocab = 2 * CDF_BLOCK + CDF_BLOCK // 2
    masses = torch.randint(0, 4, (6, vocab), generator=gen).float()
    masses[1, :CDF_BLOCK] = 0
    masses[1, 2 * CDF_BLOCK :] = 0
    masses[2, : 2 * CDF_BLOCK] = 0
    masses[3, 1500:] = 0
    masses[4] = 0
    masses[4, 7] = 1
    masses[5, :3] = 0
    uniform = torch.rand(6, generator=gen)
    uniform[3], uniform[5] = 1.0, 0.0
    tokens = inverse_cdf_ref(masses, uniform)
    assert tokens.dtype == torch.int64
    targets = (uniform * masses.sum(-1)).tolist()  # fp32, as the reference computes it (the sums are exact)
    want = [_first_past(masses[n].tolist(), targets[n]) for n in range(6)]
    assert tokens.tolist() == want
    assert want[3] == int(masses[3].nonzero().max()) and want[4] == 7 and want[5] == int(masses[5].nonzero().min())


def test_sample_tokens_ref_matches_a_loop() -> None:
    """Greedy rows (temperature 0) take their first maximum; sampled rows the first token whose cumulative tempered
    probability exceeds ``u``; every row's log-probability is its token's untempered one."""
    gen = torch.Generator().manual_seed(8)
    logits = 2 * torch.randn(4, 50, generator=gen)
    logits[0, [3, 17]] = logits[0].max() + 1.0  # a tie: the first wins
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0])
    uniform = torch.tensor([0.3, 0.25, 0.9, 0.5])
    tokens, logprobs = sample_tokens_ref(logits, temperature, uniform)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    for n in range(4):
        row = logits[n].double().tolist()
        top = max(row)
        if temperature[n] == 0:
            want = row.index(top)
        else:
            masses = [math.exp((v - top) / float(temperature[n])) for v in row]
            want = _first_past(masses, float(uniform[n]) * sum(masses))
        assert int(tokens[n]) == want, n
        lse = top + math.log(sum(math.exp(v - top) for v in row))
        assert abs(float(logprobs[n]) - (row[want] - lse)) < 1e-5
    assert int(tokens[0]) == 3
