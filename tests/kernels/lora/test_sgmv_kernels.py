"""Tests of ``kernels.lora.sgmv_kernels`` (the segmented shrink and expand Triton kernels) through their launcher,
``add_lora`` / ``sgmv.add_lora_triton``: parity with the fp32 reference ``reference.add_lora_ref`` over adapter
layouts, ranks and dtypes, and over output slices (one A shared, or one A per slice), input widths that are not a
multiple of the K tiles, split-K and prefill tilings; rows with no adapter are never written. On the CPU through
the Triton interpreter (``TRITON_INTERPRET=1``, set by scripts/test.sh), at small sizes; tests/gpu/ repeats them at
real sizes. Tolerances per dtype: ``kernel_cases.TOLERANCE``.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels import add_lora
from skyrl_clora.kernels.lora.sgmv import SgmvConfig, add_lora_triton
from tests.support.kernel_cases import DTYPES, LAYOUTS, make_problem
from tests.support.lora_parity import check_add_lora as _check_add_lora
from tests.support.markers import interpreted


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
