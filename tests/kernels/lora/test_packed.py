"""Tests of ``kernels.lora.packed`` (the host side of packed multi-LoRA training: ``PackedLoRAFunction`` and
``packed_lora_triton``): a frozen base layer added in the same autograd node (``lora_linear``) and a trainable one
refused, the launch-shape rules (row chunks, forward row tiles, shared-memory fit, warps), the column-tile limit of
the arrival counters, base weights that do not fit the layer, only the needed gradients computed, a backward that
reads a snapshot of the meta (safe after the next ``meta.build``), and an empty batch's gradients. Kernel launches
run on the CPU through the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import LoRAMeta, lora_linear, packed_lora
from skyrl_clora.kernels.lora import packed
from skyrl_clora.kernels.lora.meta import ARRIVAL_BLOCKS
from skyrl_clora.kernels.reference import packed_lora_ref
from tests.support.kernel_cases import DTYPES, TOLERANCE, rel_error
from tests.support.lora_parity import packed_case as _packed_case
from tests.support.lora_parity import packed_grads as _packed_grads
from tests.support.markers import interpreted


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["skewed", "no_adapter"])
def test_lora_linear_adds_the_adapters_into_the_base_layer(layout: str, dtype: torch.dtype) -> None:
    """``lora_linear`` (one autograd node: the expand kernels add into the base GEMMs' y and dx) against the
    torch path (base layer plus ``packed_lora_ref``), values and gradients; rows with no adapter get the base
    layer alone."""
    x, a, b, scales, slots, dy = _packed_case(layout, 16, dtype, seed=5)
    gen = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(24, 32, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
    def layer(x, a, b, scales, slots, weight, bias, **kwargs):
        return lora_linear(x, weight, bias, a, b, scales, slots, **kwargs)

    want = _packed_grads(layer, x.float(), a.float(), b.float(), scales, slots, dy.float(), weight=weight.float(),
                         bias=bias.float())
    got = _packed_grads(layer, x, a, b, scales, slots, dy, weight=weight, bias=bias, backend="triton")
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        err = rel_error(g, w, torch.zeros_like(w))
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"
    base = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    assert rel_error(got[0][slots < 0], base[slots < 0], torch.zeros_like(base[slots < 0])) < TOLERANCE[dtype]
    assert rel_error(got[0][slots >= 0], base[slots >= 0], torch.zeros_like(base[slots >= 0])) > 1e-2, "adapters count"


def test_lora_linear_rejects_a_trainable_base_layer() -> None:
    x, a, b, scales, slots, _ = _packed_case("uniform", 16, torch.float32)
    weight = torch.zeros(24, 32, requires_grad=True)
    with pytest.raises(ValueError, match="frozen"):
        packed.packed_lora_triton(x, a, b, scales, slots, weight=weight)


def test_packed_chunk_and_tile_rules() -> None:
    assert packed._chunk_rows(4096, 32, 128, 256) == 512  # benchmark, dy kernel: one chunk per 512-row slot
    assert packed._chunk_rows(4096, 16, 32, 256) == 256  # benchmark, x kernel: two chunks per slot
    assert packed._chunk_rows(4096, 16, 32, 128) == 512  # half the programs: one chunk per slot
    assert packed._chunk_rows(12_288, 8, 32, 256) == 256  # one tenant's micro-batch at 2048 features: 48 chunks
    assert packed._chunk_rows(24, 1, 32, 256) == 32  # at least one row tile
    assert packed._chunk_rows(100_000, 1, 64, 256) == 256  # a power of two of row tiles
    assert [packed._forward_rows(t, 32, 128) for t in (24, 4064, 4096)] == [16, 16, 32]
    assert [packed._forward_rows(t, 64, 64) for t in (2048, 4096)] == [32, 64]
    assert packed._fit(512, (32 + 16) * 2) == 512  # bf16 rank 16: the whole tile
    assert packed._fit(512, (32 + 64) * 4) == 128  # fp32 rank 64: cut to the shared-memory budget
    assert packed._fit(64, 1 << 20) == 16  # never below tl.dot's minimum


def _packed_grads_of(fn, x, a, b, scales, slots, dy, need, **kwargs) -> list[torch.Tensor | None]:
    leaves = [t.detach().clone().requires_grad_(n) for t, n in zip((x, a, b), need)]
    y = fn(*leaves, scales, slots, **kwargs)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def test_packed_rejects_more_column_tiles_than_counters() -> None:
    x, a, _, scales, slots, _ = _packed_case("uniform", 16, torch.float32, num_tokens=4)
    n_out = 16 * (ARRIVAL_BLOCKS + 1)
    b = torch.randn(4, n_out, 16)
    with pytest.raises(ValueError, match="needs 257: raise PackedConfig.dy_block_n"):
        packed.packed_lora_triton(x, a, b, scales, slots, config=packed.PackedConfig(dy_block_n=16))


@interpreted
@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True), (True, False, True)],
                         ids=["x", "A", "B", "x+B"])
def test_packed_computes_only_the_needed_grads(need: tuple[bool, bool, bool]) -> None:
    x, a, b, scales, slots, dy = _packed_case("no_adapter", 8, torch.float32, seed=6)
    want = _packed_grads_of(packed_lora_ref, x, a, b, scales, slots, dy, need)
    got = _packed_grads_of(packed_lora, x, a, b, scales, slots, dy, need, backend="triton")
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert rel_error(g, w, torch.zeros_like(w)) < TOLERANCE[torch.float32], name


@interpreted
def test_packed_backward_survives_meta_rebuild() -> None:
    x, a, b, scales, slots, dy = _packed_case("uniform", 16, torch.float32)
    meta = LoRAMeta(max_tokens=64, num_slots=4, device="cpu")
    meta.build(slots)
    leaves = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    y = packed_lora(*leaves, scales, slots, meta=meta, backend="triton")
    meta.build(torch.flip(slots, [0])[:30])  # the next micro-batch, before this one's backward
    y.backward(dy)
    want = _packed_grads(packed_lora_ref, x, a, b, scales, slots, dy)
    for g, w in zip([y.detach()] + [t.grad for t in leaves], want):
        assert rel_error(g, w, torch.zeros_like(w)) < TOLERANCE[torch.float32]


def test_launch_options_take_warps_by_rank() -> None:
    """4 warps up to rank 16 (padded), 8 above, unless the config names them; stages and the register cap as given."""
    assert packed._launch(None, 3, None, 16) == {"num_warps": 4, "num_stages": 3, "maxnreg": None}
    assert packed._launch(None, 2, 128, 32) == {"num_warps": 8, "num_stages": 2, "maxnreg": 128}
    assert packed._launch(2, 4, None, 64) == {"num_warps": 2, "num_stages": 4, "maxnreg": None}


def test_packed_rejects_a_base_weight_that_does_not_fit_the_layer() -> None:
    x, a, b, scales, slots, _ = _packed_case("uniform", 16, torch.float32)
    for weight in (torch.zeros(24, 31), torch.zeros(23, 32), torch.zeros(24, 32, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"the base weight must be \[24, 32\] torch.float32"):
            packed.packed_lora_triton(x, a, b, scales, slots, weight=weight)
    with pytest.raises(ValueError, match="frozen"):
        packed.packed_lora_triton(x, a, b, scales, slots, weight=torch.zeros(24, 32),
                                  bias=torch.zeros(24, requires_grad=True))


@interpreted
def test_packed_empty_batch_gets_zero_weight_gradients() -> None:
    """No rows: an empty y and dx, and exactly zero dA and dB for every slot (no kernel reads the empty batch)."""
    x, a, b, scales, slots, _ = _packed_case("uniform", 16, torch.float32, num_tokens=0)
    a, b = a + 1, b + 1  # nonzero weights: a gradient copied from them would show
    y, dx, da, db = _packed_grads(packed.packed_lora_triton, x, a, b, scales, slots, torch.zeros(0, 24))
    assert y.shape == (0, 24) and dx.shape == (0, 32)
    assert da.shape == a.shape and db.shape == b.shape and not da.any() and not db.any()
