"""Parity of the Triton multi-LoRA kernels with the fp32 torch reference, on the CPU through the Triton
interpreter (``TRITON_INTERPRET=1``, set by scripts/test.sh), at small sizes; tests/gpu/ repeats them at
real sizes. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import LoRAMeta, add_lora, lora_linear, packed_lora
from skyrl_clora.kernels.lora import packed
from skyrl_clora.kernels.lora.meta import ARRIVAL_BLOCKS
from skyrl_clora.kernels.reference import add_lora_ref, packed_lora_ref
from skyrl_clora.kernels.lora.sgmv import SgmvConfig, add_lora_triton
from tests.support.kernel_cases import (
    DTYPES,
    LAYOUTS,
    TOLERANCE,
    adapters_differ,
    make_problem,
    make_slots,
    reference_out,
    rel_error,
)
from tests.support.markers import interpreted

MIXED = {"distinct", "uniform", "zipf", "skewed", "no_adapter"}


def _check_add_lora(p, run) -> None:
    """Runs ``run(problem)`` (which updates ``p.out`` in place) and compares with the reference."""
    if p.token_slots.unique().ge(0).sum() > 1:
        assert adapters_differ(p), "adapters give equal outputs: the parity test would be vacuous"
    before = p.out.clone()
    want = reference_out(p)
    run(p)
    err = rel_error(p.out, want, before)
    assert err < TOLERANCE[p.x.dtype], f"relative error {err:.2e}"
    untouched = p.token_slots < 0
    assert torch.equal(p.out[untouched], before[untouched]), "rows with no adapter were written"


@interpreted
@pytest.mark.parametrize("layout", LAYOUTS)
def test_meta_build_groups_rows_by_slot(layout: str) -> None:
    gen = torch.Generator().manual_seed(1)
    slots = make_slots(layout, 300, 5, gen)  # more rows than one build chunk
    slots[7] = 5  # out of range: treated as no adapter
    meta = LoRAMeta(max_tokens=512, num_slots=5, device="cpu")
    meta.build(slots)
    for s in range(5):
        rows = (slots == s).nonzero().flatten()
        start, count = meta.seg_start[s].item(), meta.seg_count[s].item()
        assert count == rows.numel()
        assert torch.equal(meta.sorted_rows[start : start + count].long(), rows)
    assert meta.seg_start.tolist() == (meta.seg_count.cumsum(0) - meta.seg_count).tolist()
    no_adapter = ((slots < 0) | (slots >= 5)).nonzero().flatten()  # the null segment comes last
    assert torch.equal(meta.sorted_rows[300 - no_adapter.numel() : 300].long(), no_adapter)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_add_lora_matches_reference(layout: str, rank: int, dtype: torch.dtype) -> None:
    p = make_problem(16, 32, (32,), num_slots=4, rank=rank, dtype=dtype, layout=layout, seed=rank)
    _check_add_lora(p, lambda q: add_lora(q.out, q.x, q.lora_a, q.lora_b, q.scales, q.token_slots, backend="triton"))


CONFIGS = {
    "split_k": SgmvConfig(block_m=16, block_k=16, block_n=32, split_k=4),
    "prefill": SgmvConfig(block_m=32, block_k=32, block_n=64),
}


@interpreted
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize(
    "widths,per_slice_a", [((48, 16, 16), True), ((32, 32), False), ((40,), False)], ids=["qkv", "gate_up", "one"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_add_lora_slices_and_configs(widths: tuple[int, ...], per_slice_a: bool, config: str, dtype: torch.dtype) -> None:
    # h_in=80 is not a multiple of the K tiles: the masked K path runs too.
    p = make_problem(40, 80, widths, num_slots=5, rank=16, dtype=dtype, layout="no_adapter", per_slice_a=per_slice_a)
    cfg = CONFIGS[config]
    _check_add_lora(p, lambda q: add_lora_triton(q.out, q.x, q.lora_a, q.lora_b, q.scales, q.token_slots, config=cfg))


@interpreted
def test_meta_is_reused_across_layers_and_rebuilt_per_step() -> None:
    meta = LoRAMeta(max_tokens=64, num_slots=4, device="cpu", max_rank=16, max_slices=3)
    for step, num_tokens in enumerate((20, 33)):
        layers = [
            make_problem(num_tokens, 32, (48, 16, 16), 4, 16, torch.float32, "uniform", per_slice_a=True, seed=step),
            make_problem(num_tokens, 48, (32,), 4, 8, torch.float32, "uniform", seed=step),
        ]
        layers[1].token_slots = layers[0].token_slots
        meta.build(layers[0].token_slots)
        for p in layers:
            run = lambda q: add_lora(q.out, q.x, q.lora_a, q.lora_b, q.scales, q.token_slots, meta=meta, backend="triton")
            _check_add_lora(p, run)


def _packed_case(layout: str, rank: int, dtype: torch.dtype, num_tokens: int = 24, seed: int = 0, h_in: int = 32):
    p = make_problem(num_tokens, h_in, (24,), num_slots=4, rank=rank, dtype=dtype, layout=layout, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(num_tokens, 24, generator=gen).to(dtype)
    return p.x, p.lora_a, p.lora_b[0], p.scales, p.token_slots, dy


def _packed_grads(fn, x, a, b, scales, slots, dy, **kwargs) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    y = fn(*leaves, scales, slots, **kwargs)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


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


@interpreted
def test_packed_split_k_partials_are_summed() -> None:
    x, a, b, scales, slots, dy = _packed_case("no_adapter", 16, torch.float32, h_in=512)  # 4 K splits
    want = _packed_grads(packed_lora_ref, x, a, b, scales, slots, dy)
    got = _packed_grads(packed_lora, x, a, b, scales, slots, dy, backend="triton")
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert rel_error(g, w, torch.zeros_like(w)) < TOLERANCE[torch.float32], name


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


def test_packed_rejects_more_column_tiles_than_counters() -> None:
    x, a, _, scales, slots, _ = _packed_case("uniform", 16, torch.float32, num_tokens=4)
    n_out = 16 * (ARRIVAL_BLOCKS + 1)
    b = torch.randn(4, n_out, 16)
    with pytest.raises(ValueError, match="needs 257: raise PackedConfig.dy_block_n"):
        packed.packed_lora_triton(x, a, b, scales, slots, config=packed.PackedConfig(dy_block_n=16))


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


def test_cpu_dispatch_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    p = make_problem(16, 32, (24, 8), 3, 8, torch.float32, "no_adapter")
    want = p.out.clone()
    add_lora_ref(want, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots)
    add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots)
    assert torch.equal(p.out, want)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots, backend="triton")


def _bad_inputs() -> dict[str, tuple]:
    p = make_problem(8, 32, (16,), 3, 8, torch.float32, "uniform")
    args = (p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots)
    return {
        "x dtype": (p.out, p.x.double(), *args[2:]),
        "x stride": (p.out, torch.randn(32, 8).t(), *args[2:]),
        "out width": (p.out[:, :8], *args[1:]),
        "b not contiguous": (*args[:3], (p.lora_b[0].transpose(1, 2).contiguous().transpose(1, 2),), *args[4:]),
        "b rank": (*args[:3], (p.lora_b[0][:, :, :4].contiguous(),), *args[4:]),
        "too many slices": (torch.randn(8, 64), *args[1:3], p.lora_b * 4, *args[4:]),
        "scales dtype": (*args[:4], p.scales.double(), p.token_slots),
        "slots dtype": (*args[:5], p.token_slots.float()),
        "slots length": (*args[:5], p.token_slots[:4]),
    }


@interpreted
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_triton_wrapper_rejects_bad_inputs(case: str) -> None:
    with pytest.raises(ValueError):
        add_lora(*_bad_inputs()[case], backend="triton")


@interpreted
def test_meta_must_match_the_batch() -> None:
    p = make_problem(12, 32, (16,), 3, 8, torch.float32, "uniform")
    meta = LoRAMeta(max_tokens=16, num_slots=3, device="cpu")
    meta.build(p.token_slots[:10])
    with pytest.raises(ValueError, match="meta.build"):
        add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots, meta=meta, backend="triton")
    with pytest.raises(ValueError, match="max_tokens"):
        meta.build(torch.zeros(17, dtype=torch.int64))


@interpreted
def test_empty_batch_is_a_no_op() -> None:
    p = make_problem(0, 32, (16,), 3, 8, torch.bfloat16, "uniform")
    add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots, backend="triton")
    x = p.x.requires_grad_()
    y = packed_lora(x, p.lora_a, p.lora_b[0], p.scales, p.token_slots, backend="triton")
    assert y.shape == (0, 16)
