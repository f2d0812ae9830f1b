"""Tests of ``kernels.lora.packed_kernels`` (the packed multi-LoRA training kernels: forward, the dy and x backward
kernels and the finishing kernel) through their launcher, ``packed_lora`` / ``packed.packed_lora_triton``: values
and the gradients of x, A and B against ``reference.packed_lora_ref`` over adapter layouts, ranks and dtypes,
split-K partials, slots cut into several chunks whose weight-gradient partials the last chunk sums (in chunk order:
bit-identical on a second pass, arrival counters back at zero), and launch shapes other than the default. On the CPU
through the Triton interpreter at small sizes. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import LoRAMeta, lora_linear, packed_lora
from skyrl_clora.kernels.lora import packed
from skyrl_clora.kernels.reference import packed_lora_ref
from tests.support.kernel_cases import DTYPES, TOLERANCE, rel_error
from tests.support.lora_parity import packed_case as _packed_case
from tests.support.lora_parity import packed_grads as _packed_grads
from tests.support.markers import interpreted


PACKED_CASES = [(layout, 16) for layout in ("distinct", "uniform", "skewed", "no_adapter", "identical")] + [
    ("uniform", 8),
    ("no_adapter", 64),
]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,rank", PACKED_CASES)
def test_packed_forward_and_grads_match_reference(layout: str, rank: int, dtype: torch.dtype) -> None:
    x, a, b, scales, slots, dy = _packed_case(layout, rank, dtype, seed=rank)
    want = _packed_grads(packed_lora_ref, x.float(), a.float(), b.float(), scales, slots, dy.float())
    if layout != "identical":
        per_adapter = [packed_lora_ref(x.float(), a.float(), b.float(), scales, torch.full_like(slots, s)) for s in range(4)]
        assert not any(torch.allclose(per_adapter[0], o, atol=1e-3) for o in per_adapter[1:])
    got = _packed_grads(packed_lora, x, a, b, scales, slots, dy, backend="triton")
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        err = rel_error(g, w, torch.zeros_like(w))
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"
    for g in got[:2]:  # y and dx are written in full: exactly zero on rows with no adapter
        assert torch.equal(g[slots < 0], torch.zeros_like(g[slots < 0]))
    unused = [s for s in range(4) if not (slots == s).any()]
    for s in unused:  # an adapter with no rows gets exactly zero gradient
        assert got[2][s].abs().max() == 0 and got[3][s].abs().max() == 0


@interpreted
def test_packed_split_k_partials_are_summed() -> None:
    x, a, b, scales, slots, dy = _packed_case("no_adapter", 16, torch.float32, h_in=512)  # 4 K splits
    want = _packed_grads(packed_lora_ref, x, a, b, scales, slots, dy)
    got = _packed_grads(packed_lora, x, a, b, scales, slots, dy, backend="triton")
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert rel_error(g, w, torch.zeros_like(w)) < TOLERANCE[torch.float32], name


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("base", [False, True], ids=["lora", "base"])
def test_packed_multi_chunk_path(dtype: torch.dtype, base: bool) -> None:
    """Backward with each slot's rows cut into chunks of 32 rows (two row tiles of 16): per-chunk partials
    of dA and dB summed by the finishing kernels, uneven segments (130, 37 and 3 rows), an empty slot and
    rows with no slot; the forward with 16-row tiles."""
    config = packed.PackedConfig(dy_rows=16, x_rows=16, dy_target_programs=4, x_target_programs=4)
    T = 200
    x, a, b, scales, _, dy = _packed_case("uniform", 16, dtype, num_tokens=T, seed=3)
    slots = torch.tensor([0] * 130 + [2] * 37 + [3] * 3 + [-1] * 30)
    slots = slots[torch.randperm(T, generator=torch.Generator().manual_seed(4))]
    assert packed._chunk_rows(T, 1, 16, 4) == 32  # slot 0: 5 chunks (the last of 2 rows), slot 2: 2 chunks
    kwargs = {}
    if base:
        gen = torch.Generator().manual_seed(9)
        kwargs = {"weight": torch.randn(24, 32, generator=gen).to(dtype), "bias": torch.randn(24, generator=gen).to(dtype)}

    def reference(x, a, b, scales, slots, weight=None, bias=None):
        return lora_linear(x, weight, bias, a, b, scales, slots) if weight is not None else packed_lora(
            x, a, b, scales, slots)

    want = _packed_grads(reference, x.float(), a.float(), b.float(), scales, slots, dy.float(),
                         **{k: v.float() for k, v in kwargs.items()})
    got = _packed_grads(packed.packed_lora_triton, x, a, b, scales, slots, dy, config=config, **kwargs)
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        err = rel_error(g, w, torch.zeros_like(w))
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"
    assert got[2][1].abs().max() == 0 and got[3][1].abs().max() == 0  # slot 1 has no rows
    if not base:
        assert torch.equal(got[1][slots < 0], torch.zeros_like(got[1][slots < 0]))


@interpreted
def test_packed_last_chunk_sums_repeat_exactly() -> None:
    """Slots of several chunks have their dA / dB blocks summed by the last chunk to finish: two backward
    passes through one meta give bitwise equal gradients (the sum runs in chunk order, whichever chunk is
    last), and leave every arrival counter at zero for the next launch."""
    config = packed.PackedConfig(dy_rows=16, x_rows=16, dy_target_programs=4, x_target_programs=4)
    x, a, b, scales, slots, dy = _packed_case("skewed", 16, torch.float32, num_tokens=96, seed=11)
    assert torch.bincount(slots[slots >= 0]).max() > packed._chunk_rows(96, 1, 16, 4)  # some slot has partials
    meta = LoRAMeta(max_tokens=96, num_slots=4, device="cpu")
    meta.build(slots)
    first = _packed_grads(packed.packed_lora_triton, x, a, b, scales, slots, dy, meta=meta, config=config)
    assert not meta.arrivals.any()
    second = _packed_grads(packed.packed_lora_triton, x, a, b, scales, slots, dy, meta=meta, config=config)
    for name, g1, g2 in zip(("y", "dx", "dA", "dB"), first, second):
        assert torch.equal(g1, g2), name
    want = _packed_grads(packed_lora_ref, x, a, b, scales, slots, dy)
    for name, g, w in zip(("y", "dx", "dA", "dB"), first, want):
        assert rel_error(g, w, torch.zeros_like(w)) < TOLERANCE[torch.float32], name


PACKED_CONFIGS = {
    # every slot in one backward chunk of 128 rows (no partials); 64-row forward tiles, 2 K and 2 N iterations
    "one_chunk": packed.PackedConfig(fwd_rows=64, fwd_target_programs=1, fwd_block_k=32, fwd_block_n=16,
                                     dy_block_n=16, x_block_k=32, x_rows=128, dy_target_programs=1,
                                     x_target_programs=1),
    # 16-row chunks: partials of dA and dB for every slot over 16 rows; the launch options (not run by the
    # interpreter, but passed through)
    "many_chunks": packed.PackedConfig(fwd_rows=16, dy_rows=16, x_rows=16, dy_block_n=16, x_block_k=32,
                                       dy_target_programs=64, x_target_programs=64, fwd_warps=8, dy_warps=8,
                                       x_warps=2, fwd_stages=2, dy_stages=2, x_stages=2, dy_maxnreg=128,
                                       x_maxnreg=64),
}


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(PACKED_CONFIGS))
def test_packed_configs_match_reference(name: str, dtype: torch.dtype) -> None:
    """Launch shapes other than the default (``PackedConfig``): the same values and gradients, within the
    dtype's tolerance of the reference, at 96 rows of 4 slots (and rows with no slot), 64 features in."""
    config = PACKED_CONFIGS[name]
    x, a, b, scales, slots, dy = _packed_case("no_adapter", 16, dtype, num_tokens=96, seed=7, h_in=64)
    chunk = 128 if name == "one_chunk" else 16  # both backward kernels have 2 column tiles
    assert packed._chunk_rows(96, 2, config.dy_rows, config.dy_target_programs) == chunk
    assert packed._chunk_rows(96, 2, config.x_rows, config.x_target_programs) == chunk
    assert (torch.bincount(slots[slots >= 0]).max() > chunk) == (name == "many_chunks")
    want = _packed_grads(packed_lora_ref, x.float(), a.float(), b.float(), scales, slots, dy.float())
    got = _packed_grads(packed.packed_lora_triton, x, a, b, scales, slots, dy, config=config)
    for label, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        err = rel_error(g, w, torch.zeros_like(w))
        assert err < TOLERANCE[dtype], f"{label}: relative error {err:.2e}"
    assert torch.equal(got[1][slots < 0], torch.zeros_like(got[1][slots < 0]))
