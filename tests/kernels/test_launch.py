"""Tests of ``kernels.launch`` (what the Triton host wrappers share): no programmatic dependent launch (PDL) off a
CUDA device, the dot flags by device and dtype (fp32 operands upcast by the CPU interpreter, IEEE dots for fp32
inputs, TF32 otherwise), and the integer grid helpers ``cdiv`` and ``next_power_of_2`` against their definitions."""

from __future__ import annotations

import math

import torch

from skyrl_clora.kernels.launch import cdiv, dot_flags, has_pdl, next_power_of_2, pdl_flags


def test_no_pdl_off_a_cuda_device() -> None:
    assert has_pdl(torch.device("cpu")) is False
    assert has_pdl(torch.device("meta")) is False
    for asked in (True, False):
        assert pdl_flags(torch.zeros(1), asked) == {"PDL": False, "launch_pdl": False}


def test_dot_flags_by_device_and_dtype() -> None:
    assert dot_flags(torch.zeros(1)) == {"UPCAST": True, "DOT_PRECISION": "ieee"}
    for dtype in (torch.bfloat16, torch.float16):
        assert dot_flags(torch.zeros(1, dtype=dtype)) == {"UPCAST": True, "DOT_PRECISION": "tf32"}
    assert dot_flags(torch.zeros(1, device="meta"))["UPCAST"] is True  # only CUDA tensors multiply natively


def test_cdiv_is_the_ceiling_of_the_quotient() -> None:
    for a in range(70):
        for b in (1, 2, 3, 16, 64):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)
    assert cdiv(2**40 + 1, 2**20) == 2**20 + 1


def test_next_power_of_2_is_the_smallest_power_of_two_at_least_n() -> None:
    assert [next_power_of_2(n) for n in (-3, 0, 1, 2, 3, 4, 5, 17, 1024, 1025)] == [1, 1, 1, 2, 4, 4, 8, 32, 1024, 2048]
    for n in range(2, 300):
        power = next_power_of_2(n)
        assert power >= n and power & (power - 1) == 0 and power // 2 < n, n
