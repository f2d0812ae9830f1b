"""GPU parity of the q/k/v projection with its LoRA expand fused into q/k norm + rotary (``kernels.lora.qkv_rope``)
at Qwen3-4B's attention sizes on both of its paths, and the fused block captured in a CUDA graph, replayed
with new rows, slots and a published adapter. Skipped without CUDA. Tolerances: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

import skyrl_clora.kernels.lora.qkv_rope as qkv_rope
from skyrl_clora.kernels import LoRAMeta, folded_qkv_rope
from tests.support.kernel_cases import (
    QKVRopeProblem,
    TOLERANCE,
    adapters_differ,
    capture_graph,
    check_kv_cache_write,
    make_qkv_rope_problem,
    qkv_rope_ref_fp32,
    rel_error,
)

pytestmark = pytest.mark.gpu


def fused(p: QKVRopeProblem, meta: LoRAMeta | None = None) -> tuple[torch.Tensor, ...]:
    lora = p.lora
    return folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, p.head_dim, p.cos, p.sin,
                           p.q_weight, p.k_weight, p.eps, meta=meta)


def check(p: QKVRopeProblem, got: tuple[torch.Tensor, ...], label: str = "") -> None:
    torch.cuda.synchronize()
    want = qkv_rope_ref_fp32(p)
    for name, g, w in zip("qk", got[:2], want[:2]):
        err = float((g.float() - w).abs().max() / w.abs().max())
        assert err < TOLERANCE[torch.bfloat16], f"{label}{name}: relative error {err:.2e}"
    base_v = p.lora.out[:, -got[2].shape[1] * p.head_dim:].reshape(got[2].shape)
    err = rel_error(got[2], want[2], base_v)
    assert err < TOLERANCE[torch.bfloat16], f"{label}v: relative error {err:.2e}"


@pytest.mark.parametrize("fold", [True, False], ids=["folded-gemm", "base-gemm-and-shrink"])
@pytest.mark.parametrize("num_slots,layout", [(8, "no_adapter"), (32, "uniform")])
@pytest.mark.parametrize("num_tokens", [16, 256, 4096])
def test_fused_qkv_rope_matches_reference_at_qwen3_4b_sizes(num_tokens: int, num_slots: int, layout: str, fold: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    p = make_qkv_rope_problem(num_tokens, 2560, 32, 8, 128, num_slots, 16, torch.bfloat16, layout, with_norm=True,
                              device="cuda", seed=num_tokens + num_slots)
    assert adapters_differ(p.lora), "adapters give equal outputs: the parity test would be vacuous"
    monkeypatch.setattr(qkv_rope, "fold_pays", lambda *shape: fold)
    check(p, fused(p))


@pytest.mark.parametrize("num_tokens", [64, 512])
def test_k_and_v_go_into_the_cache_as_the_fused_block_returns_them(num_tokens: int) -> None:
    """The sampling engine's path at Qwen3-1.7B's attention shape: k and v stored into a slot K/V cache."""
    p = make_qkv_rope_problem(num_tokens, 2048, 16, 8, 128, 8, 16, torch.bfloat16, "uniform", with_norm=True,
                              device="cuda", seed=num_tokens)
    check_kv_cache_write(p, cache_rows=num_tokens + 1, cache_len=640)


def test_k_and_v_go_into_an_fp8_cache_as_torch_casts_them() -> None:
    """The same write into a float8 e4m3 cache on the GPU's own fp8 conversion: each entry is torch's cast of
    the fused block's k and v."""
    p = make_qkv_rope_problem(512, 2048, 16, 8, 128, 8, 16, torch.bfloat16, "uniform", with_norm=True,
                              device="cuda", seed=3)
    check_kv_cache_write(p, cache_rows=513, cache_len=640, cache_dtype=torch.float8_e4m3fn)


def test_fused_qkv_rope_captured_in_cuda_graph_replays_new_batches_and_publishes() -> None:
    T, S = 64, 8
    p = make_qkv_rope_problem(T, 2560, 32, 8, 128, S, 16, torch.bfloat16, "uniform", with_norm=True, device="cuda")
    slots = torch.zeros(T, dtype=torch.int64, device="cuda")
    p.lora.token_slots = slots
    meta = LoRAMeta(max_tokens=T, num_slots=S, device="cuda", max_rank=16, max_slices=3)

    def step() -> tuple[torch.Tensor, ...]:
        meta.build(slots)
        return fused(p, meta)

    graph, outs, _ = capture_graph(step)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for replay in range(3):
        slots.copy_(torch.randint(-1, S, (T,), device="cuda", generator=gen))
        p.lora.x.copy_(torch.randn(p.lora.x.shape, device="cuda", generator=gen))
        published = p.folded.lora_a[:, replay + 1]  # slot replay + 1 of every slice, in place
        published.copy_(torch.randn(published.shape, device="cuda", generator=gen) * 0.02)
        p.lora.lora_b[0][replay + 1].mul_(-1)
        graph.replay()
        p.lora.out = torch.nn.functional.linear(p.lora.x, p.folded.base_weight, p.folded.base_bias)
        check(p, outs, f"replay {replay}: ")
