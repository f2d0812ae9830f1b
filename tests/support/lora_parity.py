"""Parity checks of the multi-LoRA Triton ops shared by several kernel test files: ``add_lora`` against the fp32
reference (tests/kernels/lora/test_sgmv_kernels.py, test_meta.py), random packed-LoRA problems with their values
and gradients (test_packed.py, test_packed_kernels.py), and the fused q/k/v projection + norm + rotary against its
fp32 reference (tests/kernels/lora/test_qkv_rope.py, tests/kernels/test_qkv_dispatch.py). Tolerances per dtype:
``kernel_cases.TOLERANCE``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from skyrl_clora.kernels import LoRAMeta, folded_qkv_rope
from tests.support.kernel_cases import (
    TOLERANCE,
    LoRAProblem,
    QKVRopeProblem,
    adapters_differ,
    make_problem,
    qkv_rope_ref_fp32,
    reference_out,
    rel_error,
)


def check_add_lora(p: LoRAProblem, run: Callable[[LoRAProblem], None]) -> None:
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


def packed_case(layout: str, rank: int, dtype: torch.dtype, num_tokens: int = 24, seed: int = 0,
                h_in: int = 32) -> tuple[torch.Tensor, ...]:
    """``(x, lora_a, lora_b, scales, token_slots, dy)`` of a random ``packed_lora`` problem over 4 slots, 24
    features out (``kernel_cases.make_problem``), with a random output gradient ``dy`` in ``dtype``."""
    p = make_problem(num_tokens, h_in, (24,), num_slots=4, rank=rank, dtype=dtype, layout=layout, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(num_tokens, 24, generator=gen).to(dtype)
    return p.x, p.lora_a, p.lora_b[0], p.scales, p.token_slots, dy


def packed_grads(fn: Callable[..., torch.Tensor], x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 scales: torch.Tensor, slots: torch.Tensor, dy: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    """``[y, dx, dA, dB]`` of ``fn(x, a, b, scales, slots, **kwargs)`` backpropagated from ``dy``."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    y = fn(*leaves, scales, slots, **kwargs)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def run_qkv_rope(p: QKVRopeProblem, backend: str, meta: LoRAMeta | None = None) -> tuple[torch.Tensor, ...]:
    """``folded_qkv_rope`` on ``p`` with ``backend``: ``(q, k, v)``."""
    lora = p.lora
    return folded_qkv_rope(lora.x, p.folded, lora.lora_b, lora.scales, lora.token_slots, p.head_dim, p.cos, p.sin,
                           p.q_weight, p.k_weight, p.eps, meta=meta, backend=backend)


def check_qkv_rope(p: QKVRopeProblem, got: tuple[torch.Tensor, ...]) -> None:
    """q and k within the dtype's tolerance of the fp32 reference (relative to their largest entry), v relative
    to the LoRA update (as the folded layer's tests), and rows with no adapter as the base layer gives them."""
    dtype = p.lora.x.dtype
    want = qkv_rope_ref_fp32(p)
    for name, g, w in zip("qk", got[:2], want[:2]):
        err = float((g.float() - w).abs().max() / w.abs().max())
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.2e}"
    base_v = p.lora.out[:, -got[2].shape[1] * p.head_dim:].reshape(got[2].shape)
    err = rel_error(got[2], want[2], base_v)
    assert err < TOLERANCE[dtype], f"v: relative error {err:.2e}"
    no_adapter = p.lora.token_slots < 0
    torch.testing.assert_close(got[2][no_adapter], base_v[no_adapter])
