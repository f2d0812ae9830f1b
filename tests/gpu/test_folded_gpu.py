"""GPU parity of multi-LoRA layers with their slots' A folded into the base weight (``kernels.lora.folded``) at real
sizes, on both Triton paths, and a decode step of folded layers captured in a CUDA graph, replayed with new
rows, slots and a published adapter. Skipped without CUDA. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

import skyrl_clora.kernels.dispatch as dispatch
from skyrl_clora.kernels import LoRAMeta, folded_lora_linear
from tests.support.kernel_cases import (
    TOLERANCE,
    adapters_differ,
    capture_graph,
    fold_problem,
    make_problem,
    reference_out,
    rel_error,
)

pytestmark = pytest.mark.gpu
SHAPES = {  # Qwen3-4B's projections and hidden 4096: (h_in, widths, one A per slice)
    "qkv": (2560, (4096, 1024, 1024), True),
    "o": (4096, (2560,), False),
    "gate_up": (2560, (9728, 9728), True),
    "down": (9728, (2560,), False),
    "h4096": (4096, (4096,), False),
}


def _check(p, folded, meta=None) -> None:
    before = p.out.clone()
    want = reference_out(p)
    got = folded_lora_linear(p.x, folded, p.lora_b, p.scales, p.token_slots, meta=meta)
    torch.cuda.synchronize()
    err = rel_error(got, want, before)
    assert err < TOLERANCE[p.x.dtype], f"relative error {err:.2e}"
    torch.testing.assert_close(got[p.token_slots < 0], before[p.token_slots < 0])


@pytest.mark.parametrize("fold", [True, False], ids=["folded-gemm", "base-gemm-and-shrink"])
@pytest.mark.parametrize("num_slots,layout", [(8, "no_adapter"), (32, "uniform")])
@pytest.mark.parametrize("num_tokens", [16, 4096])
@pytest.mark.parametrize("shape", SHAPES)
def test_folded_layer_matches_reference_at_real_sizes(shape: str, num_tokens: int, num_slots: int, layout: str,
                                                      fold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    h_in, widths, per_slice_a = SHAPES[shape]
    p = make_problem(num_tokens, h_in, widths, num_slots, 16, torch.bfloat16, layout, per_slice_a=per_slice_a,
                     device="cuda", seed=num_tokens + num_slots)
    folded = fold_problem(p, with_bias=shape == "qkv", seed=num_slots)
    assert adapters_differ(p), "adapters give equal outputs: the parity test would be vacuous"
    monkeypatch.setattr(dispatch, "fold_pays", lambda *shape: fold)
    _check(p, folded)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rank", [8, 64])
def test_folded_layer_ranks_and_dtypes(rank: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    p = make_problem(64, 2560, (4096, 1024, 1024), 8, rank, dtype, "uniform", per_slice_a=True, device="cuda")
    folded = fold_problem(p, with_bias=False)
    monkeypatch.setattr(dispatch, "fold_pays", lambda *shape: True)
    _check(p, folded)


def test_folded_decode_step_captured_in_cuda_graph_replays_new_batches_and_publishes() -> None:
    """meta.build + the four folded projections of a layer captured once; replays see new rows, slots and an
    adapter published in place into the folded weight."""
    T, S = 64, 8
    shapes = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    problems = [make_problem(T, h_in, widths, S, 16, torch.bfloat16, "uniform", per_slice_a=per_slice, device="cuda",
                             seed=i) for i, (h_in, widths, per_slice) in enumerate(shapes)]
    layers = [(p, fold_problem(p, with_bias=False, seed=i)) for i, p in enumerate(problems)]
    for p, folded in layers:
        p.lora_a = folded.lora_a  # the reference reads the folded weight's A rows, as publishes write them
    slots = torch.zeros(T, dtype=torch.int64, device="cuda")
    meta = LoRAMeta(max_tokens=T, num_slots=S, device="cuda", max_rank=16, max_slices=3)

    def step() -> list[torch.Tensor]:
        meta.build(slots)
        return [folded_lora_linear(p.x, folded, p.lora_b, p.scales, slots, meta=meta) for p, folded in layers]

    graph, outs, _ = capture_graph(step)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for replay in range(3):
        new_slots = torch.randint(-1, S, (T,), device="cuda", generator=gen)
        slots.copy_(new_slots)
        for p, _ in layers:
            p.x.copy_(torch.randn(p.x.shape, device="cuda", generator=gen))
            published = p.lora_a[..., replay + 1, :, :]  # slot replay + 1 of every slice
            published.copy_(torch.randn(published.shape, device="cuda", generator=gen) * 0.02)
            p.token_slots = new_slots
        graph.replay()
        torch.cuda.synchronize()
        for (p, folded), got in zip(layers, outs):
            p.out = torch.nn.functional.linear(p.x, folded.base_weight)
            want = reference_out(p)
            err = rel_error(got, want, p.out)
            assert err < TOLERANCE[torch.bfloat16], f"replay {replay}: relative error {err:.2e}"
