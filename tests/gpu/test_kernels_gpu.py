"""GPU parity of the Triton multi-LoRA kernels at real sizes, and CUDA-graph capture and replay of a decode
step; the dense one-slot layer and the trainer's atomics-free key gather at training sizes. Skipped without
CUDA. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_clora.kernels import LoRAMeta, add_lora, dense_lora_linear, gather_rows, lora_linear, packed_lora
from skyrl_clora.kernels.layers.gather_ops import inverse_index
from skyrl_clora.kernels.reference import packed_lora_ref
from skyrl_clora.kernels.lora.sgmv import SgmvConfig, add_lora_triton
from tests.support.kernel_cases import (
    DTYPES,
    LAYOUTS,
    TOLERANCE,
    adapters_differ,
    capture_graph,
    make_problem,
    reference_out,
    rel_error,
)

pytestmark = pytest.mark.gpu


def _check(p, run) -> None:
    if p.token_slots.unique().ge(0).sum() > 1:
        assert adapters_differ(p), "adapters give equal outputs: the parity test would be vacuous"
    before = p.out.clone()
    want = reference_out(p)
    run(p)
    torch.cuda.synchronize()
    err = rel_error(p.out, want, before)
    assert err < TOLERANCE[p.x.dtype], f"relative error {err:.2e}"
    untouched = p.token_slots < 0
    assert torch.equal(p.out[untouched], before[untouched]), "rows with no adapter were written"


def _dispatch(p) -> None:
    add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, p.token_slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_shape_matches_reference(layout: str, rank: int, dtype: torch.dtype) -> None:
    p = make_problem(256, 4096, (4096,), num_slots=32, rank=rank, dtype=dtype, layout=layout, device="cuda")
    _check(p, _dispatch)


@pytest.mark.parametrize("layout", ["uniform", "skewed", "no_adapter", "zipf"])
@pytest.mark.parametrize("num_tokens", [16, 4096])
@pytest.mark.parametrize(
    "h_in,widths,per_slice_a",
    [(2560, (4096, 1024, 1024), True), (2560, (9728, 9728), True), (9728, (2560,), False), (4096, (4096,), False)],
    ids=["qkv", "gate_up", "down", "h4096"],
)
def test_qwen3_4b_shapes_match_reference(h_in: int, widths, per_slice_a: bool, num_tokens: int, layout: str) -> None:
    p = make_problem(
        num_tokens, h_in, widths, 8, 16, torch.bfloat16, layout, per_slice_a=per_slice_a, device="cuda", seed=num_tokens
    )
    _check(p, _dispatch)


@pytest.mark.parametrize(
    "config",
    [SgmvConfig(split_k=32, block_k=64), SgmvConfig(block_m=128, block_k=64, num_warps=8)],
    ids=["split32", "bm128"],
)
def test_configs_match_reference(config: SgmvConfig) -> None:
    p = make_problem(300, 2560, (4096, 1024, 1024), 8, 16, torch.bfloat16, "no_adapter", per_slice_a=True, device="cuda")
    _check(p, lambda q: add_lora_triton(q.out, q.x, q.lora_a, q.lora_b, q.scales, q.token_slots, config=config))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "num_tokens,layout,rank", [(4096, "skewed", 16), (4096, "no_adapter", 64), (200, "no_adapter", 16)]
)
def test_packed_grads_match_reference(num_tokens: int, layout: str, rank: int, dtype: torch.dtype) -> None:
    p = make_problem(num_tokens, 1024, (768,), 8, rank, dtype, layout, device="cuda", seed=rank)
    dy = torch.randn(num_tokens, 768, device="cuda", dtype=dtype)
    results = []
    for fn, cast in ((packed_lora_ref, torch.float32), (packed_lora, dtype)):
        leaves = [t.detach().to(cast).requires_grad_() for t in (p.x, p.lora_a, p.lora_b[0])]
        y = fn(*leaves, p.scales, p.token_slots)
        y.backward(dy.to(cast))
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("y", "dx", "dA", "dB"), results[1], results[0]):
        err = rel_error(got, want, torch.zeros_like(want))
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"
    no_adapter = p.token_slots < 0
    for got in results[1][:2]:  # y and dx are written in full: exactly zero where there is no adapter
        assert torch.equal(got[no_adapter], torch.zeros_like(got[no_adapter]))


@pytest.mark.parametrize("base", [False, True], ids=["lora", "base"])
@pytest.mark.parametrize("shape", ["bench", "one_slot_12k"])
def test_packed_training_shapes_match_reference(shape: str, base: bool) -> None:
    """bf16 values and all gradients against the fp32 reference (with a base layer: ``lora_linear`` against
    the base layer plus the reference) at the benchmark's shape (8 adapters of 512 contiguous rows, hidden
    4096, rank 16: one chunk per slot) and at one tenant's micro-batch (12,288 rows in one slot of four,
    256 rows with no slot, 2048 features: 24 chunks, partial sums)."""
    gen = torch.Generator().manual_seed(7)
    if shape == "bench":
        num_slots, h_in, h_out, slots = 8, 4096, 4096, torch.arange(8).repeat_interleave(512)
    else:
        num_slots, h_in, h_out = 4, 2048, 2048
        slots = torch.cat([torch.full((12_288,), 2), torch.full((256,), -1)])[torch.randperm(12_544, generator=gen)]
    T, rank = slots.shape[0], 16
    x, dy = torch.randn(T, h_in, generator=gen), torch.randn(T, h_out, generator=gen)
    a = torch.randn(num_slots, rank, h_in, generator=gen) / h_in**0.5
    b = torch.randn(num_slots, h_out, rank, generator=gen)
    weight = torch.randn(h_out, h_in, generator=gen) / h_in**0.5
    scales, slots = (torch.rand(num_slots, generator=gen) + 0.5).cuda(), slots.cuda()
    results = []
    for cast, backend in ((torch.float32, "torch"), (torch.bfloat16, "triton")):
        leaves = [t.cuda().to(cast).requires_grad_() for t in (x, a, b)]
        if base:
            y = lora_linear(leaves[0], weight.cuda().to(cast), None, *leaves[1:], scales, slots, backend=backend)
        else:
            y = packed_lora(*leaves, scales, slots, backend=backend)
        y.backward(dy.cuda().to(cast))
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("y", "dx", "dA", "dB"), results[1], results[0]):
        err = rel_error(got, want, torch.zeros_like(want))
        assert err < TOLERANCE[torch.bfloat16], f"{name}: relative error {err:.2e}"
    used = slots.unique()
    for s in range(num_slots):  # a slot with no rows gets exactly zero gradients
        if s not in used:
            assert results[1][2][s].abs().max() == 0 and results[1][3][s].abs().max() == 0


def test_packed_training_step_captured_in_cuda_graph() -> None:
    """Forward and ``torch.autograd.grad`` wrt x, A and B (the benchmark's call, with a meta) captured in one
    CUDA graph: replays with new x, dy and slots match the eager call."""
    T, S, h, rank = 2048, 4, 1024, 16
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(T, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    a = (torch.randn(S, rank, h, device="cuda", dtype=torch.bfloat16, generator=gen) / 32).requires_grad_()
    b = torch.randn(S, h, rank, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dy = torch.randn(T, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    scales = torch.tensor([2.0, 0.5, 1.0, 3.0], device="cuda")
    slots = torch.randint(-1, S, (T,), device="cuda", generator=gen)
    meta = LoRAMeta(max_tokens=T, num_slots=S, device="cuda", max_rank=rank)

    def step() -> tuple[torch.Tensor, ...]:
        meta.build(slots)
        y = packed_lora(x, a, b, scales, slots, meta=meta)
        return (y.detach(),) + torch.autograd.grad(y, (x, a, b), dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for replay in range(3):
        slots.copy_(torch.randint(-1 if replay else 0, S, (T,), device="cuda", generator=gen))
        with torch.no_grad():
            x.copy_(torch.randn(T, h, device="cuda", generator=gen))
        dy.copy_(torch.randn(T, h, device="cuda", generator=gen))
        graph.replay()
        want = step()
        for name, got, w in zip(("y", "dx", "dA", "dB"), captured, want):
            assert torch.equal(got, w), f"replay {replay}: {name} differs from the eager call"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [256, 4096])
def test_lora_linear_matches_base_layer_plus_reference(num_tokens: int, dtype: torch.dtype) -> None:
    """The one-node LoRA linear layer (expand kernels adding into the base GEMMs' y and dx) against the
    base layer plus the fp32 reference, values and gradients."""
    p = make_problem(num_tokens, 1024, (768,), 8, 16, dtype, "skewed", device="cuda", seed=3)
    dy = torch.randn(num_tokens, 768, device="cuda", dtype=dtype)
    weight = torch.randn(768, 1024, device="cuda", dtype=dtype) / 32
    results = []
    for cast, backend in ((torch.float32, "torch"), (dtype, "triton")):
        leaves = [t.detach().to(cast).requires_grad_() for t in (p.x, p.lora_a, p.lora_b[0])]
        y = lora_linear(leaves[0], weight.to(cast), None, leaves[1], leaves[2], p.scales, p.token_slots, backend=backend)
        y.backward(dy.to(cast))
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("y", "dx", "dA", "dB"), results[1], results[0]):
        err = rel_error(got, want, torch.zeros_like(want))
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"


def test_cuda_dispatch_takes_the_triton_path() -> None:
    p = make_problem(32, 256, (128,), 4, 16, torch.bfloat16, "uniform", device="cuda")
    b = p.lora_b[0].transpose(1, 2).contiguous().transpose(1, 2)  # the reference would accept this
    with pytest.raises(ValueError, match="contiguous"):
        add_lora(p.out, p.x, p.lora_a, (b,), p.scales, p.token_slots)


def test_decode_step_captured_in_cuda_graph_replays_new_batches() -> None:
    """meta.build + three layers captured once; replays with new rows and slots match the reference."""
    T, S = 64, 8
    layers = [
        make_problem(T, 2560, (4096, 1024, 1024), S, 16, torch.bfloat16, "uniform", per_slice_a=True, device="cuda"),
        make_problem(T, 4096, (2560,), S, 16, torch.bfloat16, "uniform", device="cuda", seed=1),
        make_problem(T, 2560, (9728, 9728), S, 64, torch.bfloat16, "uniform", per_slice_a=True, device="cuda", seed=2),
    ]
    slots = torch.zeros(T, dtype=torch.int64, device="cuda")
    meta = LoRAMeta(max_tokens=T, num_slots=S, device="cuda", max_rank=64)

    def step() -> None:
        meta.build(slots)
        for p in layers:
            add_lora(p.out, p.x, p.lora_a, p.lora_b, p.scales, slots, meta=meta)

    graph, _, step_allocated = capture_graph(step)
    assert step_allocated == 0, f"the captured decode step allocated {step_allocated} bytes"
    gen = torch.Generator(device="cuda").manual_seed(5)
    for layout_seed in range(3):
        new_slots = torch.randint(-1, S, (T,), device="cuda", generator=gen)
        slots.copy_(new_slots)
        wants, befores = [], []
        for p in layers:
            p.x.copy_(torch.randn(p.x.shape, device="cuda", generator=gen))
            p.token_slots = new_slots
            befores.append(p.out.clone())
            wants.append(reference_out(p))
        graph.replay()
        torch.cuda.synchronize()
        for p, want, before in zip(layers, wants, befores):
            err = rel_error(p.out, want, before)
            assert err < TOLERANCE[torch.bfloat16], f"replay {layout_seed}: relative error {err:.2e}"
            assert torch.equal(p.out[new_slots < 0], before[new_slots < 0])


def test_dense_one_slot_layer_matches_the_triton_routed_layer_at_training_sizes() -> None:
    """``dense_lora_linear`` (cuBLAS) against ``lora_linear``'s Triton path with every row in that slot: bf16,
    a 4,096-token micro-batch of the 1.7B model's MLP up projection, values and all gradients."""
    gen = torch.Generator().manual_seed(5)
    tokens, h_in, h_out, slots, rank = 4096, 2048, 6144, 2, 16
    x = torch.randn(tokens, h_in, generator=gen).cuda().bfloat16()
    weight = (torch.randn(h_out, h_in, generator=gen) / 45).cuda().bfloat16()
    lora_a = (torch.randn(slots, rank, h_in, generator=gen) / 45).cuda().bfloat16()
    lora_b = (torch.randn(slots, h_out, rank, generator=gen) / 4).cuda().bfloat16()
    scales = torch.tensor([2.0, 0.5], device="cuda")
    dy = torch.randn(tokens, h_out, generator=gen).cuda().bfloat16()
    token_slots = torch.ones(tokens, dtype=torch.long, device="cuda")
    results = []
    for op in (lambda t, a, b: lora_linear(t, weight, None, a, b, scales, token_slots),
               lambda t, a, b: dense_lora_linear(t, weight, None, a, b, scales, 1)):
        leaves = [t.clone().requires_grad_(True) for t in (x, lora_a, lora_b)]
        y = op(*leaves)
        y.backward(dy)
        results.append([y.detach()] + [leaf.grad for leaf in leaves])
    for want, got in zip(*results):
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert err < 2e-2, err
    assert results[1][2][0].abs().sum() == 0 and results[1][2][1].abs().sum() > 0


def test_gather_rows_gradient_matches_index_add_at_a_micro_batchs_keys() -> None:
    """The shared-prompt pass's key gather of one e2e micro-batch (4 prompts of 256 tokens, 8 rows each with a
    364-token response; bf16 ``[N, 8, 128]`` keys): the Triton segmented-sum backward against ``index_add_`` in
    float32."""
    prompts, rows, response = 4, 8, 364
    prompt_tokens = np.arange(prompts * 256).reshape(prompts, 256)
    cursor, key_index = prompts * 256, [np.arange(prompts * 256)]
    for row in range(prompts * rows):
        key_index += [prompt_tokens[row // rows], np.arange(cursor, cursor + response)]
        cursor += response
    index_np = np.concatenate(key_index)
    starts, sources = (torch.from_numpy(a).cuda() for a in inverse_index(index_np, cursor))
    index = torch.from_numpy(index_np).cuda()
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(8, cursor, 128, generator=gen).cuda().bfloat16().requires_grad_(True)  # [KV, N, d]
    dy = torch.randn(len(index_np), 8, 128, generator=gen).cuda().bfloat16()
    gather_rows(keys.transpose(0, 1), index, starts, sources).backward(dy)
    want = torch.zeros(cursor, 8, 128, device="cuda").index_add_(0, index, dy.float()).transpose(0, 1)
    assert want[:, : prompts * 256].abs().mean() > 2 * want[:, prompts * 256 :].abs().mean()  # prompts: 9 terms
    torch.testing.assert_close(keys.grad.float(), want, rtol=1e-2, atol=2e-2)
