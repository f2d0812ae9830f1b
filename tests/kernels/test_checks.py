"""Tests of ``kernels.checks`` (the argument checks of the Triton host wrappers, raised as ValueError before any
launch): well-formed arguments pass, and each wrong dtype, shape, stride or device is refused with a message naming
it, for ``check_add_lora`` (one A, or one A per slice), ``check_packed``, ``check_decode_attention`` and
``check_prefill_attention`` (slot and paged layouts, fp8 caches), ``check_attention_head_dim``, ``check_rows_op``,
``check_silu_mul``, ``check_chosen_logprobs`` and ``check_frozen_base``."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.kernels.checks import (
    FP8_CACHE_DTYPE,
    check_add_lora,
    check_attention_head_dim,
    check_chosen_logprobs,
    check_decode_attention,
    check_frozen_base,
    check_packed,
    check_prefill_attention,
    check_rows_op,
    check_silu_mul,
)


def _add_lora_args(per_slice_a: bool = False) -> dict[str, object]:
    """Well-formed ``check_add_lora`` arguments: 4 rows of 6 features, 3 slots of rank 2, slices 5 and 3 wide."""
    return {
        "out": torch.zeros(4, 8),
        "x": torch.zeros(4, 6),
        "lora_a": torch.zeros(2, 3, 2, 6) if per_slice_a else torch.zeros(3, 2, 6),
        "lora_b": (torch.zeros(3, 5, 2), torch.zeros(3, 3, 2)),
        "scales": torch.ones(3),
        "token_slots": torch.tensor([0, -1, 2, 1]),
    }


BAD_ADD_LORA = {
    "x dtype": ({"x": torch.zeros(4, 6, dtype=torch.int32)}, "x must be one of"),
    "x 1-D": ({"x": torch.zeros(4)}, r"x must be 2-D \[tokens, features\]"),
    "x stride": ({"x": torch.zeros(6, 4).t()}, "x must have unit stride along features"),
    "out dtype": ({"out": torch.zeros(4, 8, dtype=torch.float64)}, "out has dtype torch.float64, expected torch.float32"),
    "out rows": ({"out": torch.zeros(5, 8)}, "out has 5 rows, x has 4"),
    "b a tensor": ({"lora_b": torch.zeros(3, 8, 2)}, "lora_b must be a tuple of 1..3 tensors"),
    "four slices": ({"lora_b": (torch.zeros(3, 2, 2),) * 4}, "lora_b must be a tuple of 1..3 tensors"),
    "a slices": ({"lora_a": torch.zeros(3, 3, 2, 6)}, "lora_a has 3 slices, lora_b has 2"),
    "a 2-D": ({"lora_a": torch.zeros(2, 6)}, r"lora_a must be \[S, R, H_in\] or \[slices, S, R, H_in\]"),
    "a dtype": ({"lora_a": torch.zeros(3, 2, 6, dtype=torch.float16)}, "lora_a must be contiguous torch.float32"),
    "a strided": ({"lora_a": torch.zeros(3, 6, 2).transpose(1, 2)}, "lora_a must be contiguous torch.float32"),
    "a features": ({"lora_a": torch.zeros(3, 2, 7)}, "lora_a takes 7 input features, x has 6"),
    "b slots": ({"lora_b": (torch.zeros(2, 5, 2), torch.zeros(3, 3, 2))}, r"lora_b\[0\] must be \[3, H_out, 2\]"),
    "b rank": ({"lora_b": (torch.zeros(3, 5, 2), torch.zeros(3, 3, 4))}, r"lora_b\[1\] must be \[3, H_out, 2\]"),
    "b strided": ({"lora_b": (torch.zeros(3, 2, 5).transpose(1, 2), torch.zeros(3, 3, 2))},
                  r"lora_b\[0\] must be contiguous torch.float32"),
    "widths": ({"lora_b": (torch.zeros(3, 4, 2), torch.zeros(3, 3, 2))}, "lora_b slices are 7 wide in total, out has 8"),
    "scales length": ({"scales": torch.ones(2)}, r"scales must be \[3\]"),
    "scales dtype": ({"scales": torch.ones(3, dtype=torch.float64)}, "scales must be contiguous float32"),
    "slots length": ({"token_slots": torch.zeros(3, dtype=torch.int64)}, r"token_slots must be \[4\]"),
    "slots dtype": ({"token_slots": torch.zeros(4)}, "token_slots must be int32 or int64"),
    "slots strided": ({"token_slots": torch.zeros(8, dtype=torch.int64)[::2]}, "token_slots must be contiguous"),
    "devices": ({"scales": torch.ones(3, device="meta")}, "all tensors must be on one device"),
}


def test_check_add_lora_accepts_one_a_or_one_a_per_slice() -> None:
    check_add_lora(**_add_lora_args())
    check_add_lora(**_add_lora_args(per_slice_a=True))
    check_add_lora(**{**_add_lora_args(), "token_slots": torch.tensor([0, -1, 2, 1], dtype=torch.int32)})


@pytest.mark.parametrize("case", list(BAD_ADD_LORA))
def test_check_add_lora_names_what_is_wrong(case: str) -> None:
    change, message = BAD_ADD_LORA[case]
    with pytest.raises(ValueError, match=message):
        check_add_lora(**{**_add_lora_args(), **change})


def test_check_packed() -> None:
    x, a, b, scales, slots = torch.zeros(4, 6), torch.zeros(3, 2, 6), torch.zeros(3, 5, 2), torch.ones(3), torch.tensor(
        [0, -1, 2, 1])
    check_packed(x, a, b, scales, slots)
    for args, message in [
        ((x.double(), a, b, scales, slots), "x must be one of"),
        ((x, torch.zeros(3, 2, 7), b, scales, slots), r"lora_a must be \[P, R, 6\]"),
        ((x, torch.zeros(2, 6), b, scales, slots), r"lora_a must be \[P, R, 6\]"),
        ((x, a, torch.zeros(2, 5, 2), scales, slots), r"lora_b must be \[3, H_out, 2\]"),
        ((x, a, torch.zeros(3, 5, 3), scales, slots), r"lora_b must be \[3, H_out, 2\]"),
        ((x, a.half(), b, scales, slots), "lora_a must be contiguous torch.float32"),
        ((x, a, torch.zeros(3, 2, 5).transpose(1, 2), scales, slots), "lora_b must be contiguous torch.float32"),
        ((x, a, b, torch.ones(2), slots), r"scales must be \[3\]"),
        ((x, a, b, scales, slots[:3]), r"token_slots must be \[4\]"),
        ((x, a, b, scales, slots.to("meta")), "all tensors must be on one device"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_packed(*args)


def _decode_args(**change: object) -> dict[str, object]:
    """``check_decode_attention`` arguments (2 rows, 4 query heads over 2 kv heads of dim 8, a slot cache of 3 rows of
    16 positions), with ``change`` applied."""
    args = {"q": torch.zeros(2, 4, 8), "k_cache": torch.zeros(3, 2, 16, 8), "v_cache": torch.zeros(3, 2, 16, 8),
            "lengths": torch.tensor([5, 16]), "out": None, "max_head_dim": 256}
    return {**args, **change}


def test_check_decode_attention_accepts_slot_paged_and_fp8_caches() -> None:
    check_decode_attention(**_decode_args())
    check_decode_attention(**_decode_args(out=torch.zeros(2, 4, 8), prefix_rows=torch.tensor([0, 0]),
                                          prefix_lens=torch.tensor([3, 0], dtype=torch.int32)))
    fp8 = torch.zeros(3, 2, 16, 8, dtype=FP8_CACHE_DTYPE)
    check_decode_attention(**_decode_args(k_cache=fp8, v_cache=fp8.clone()))
    blocks = torch.zeros(5, 2, 4, 8)  # 5 blocks of 4 positions
    check_decode_attention(**_decode_args(k_cache=blocks, v_cache=blocks, block_tables=torch.zeros(2, 4, dtype=torch.int32)))


BAD_DECODE = {
    "prefix rows alone": ({"prefix_rows": torch.tensor([0, 0])}, "prefix_rows and prefix_lens go together"),
    "prefix shape": ({"prefix_rows": torch.tensor([0]), "prefix_lens": torch.tensor([1])}, r"prefix_rows must be \[B\]"),
    "prefix dtype": ({"prefix_rows": torch.tensor([0, 0]), "prefix_lens": torch.tensor([1.0, 0.0])},
                     r"prefix_lens must be \[B\] int32/int64"),
    "q 2-D": ({"q": torch.zeros(2, 32)}, r"q must be \[B, H, d\]"),
    "q int": ({"q": torch.zeros(2, 4, 8, dtype=torch.int32)}, r"q must be \[B, H, d\]"),
    "caches differ": ({"v_cache": torch.zeros(3, 2, 8, 8)}, r"k_cache and v_cache must both be \[S, KV, L, d\]"),
    "cache head dim": ({"k_cache": torch.zeros(3, 2, 16, 4), "v_cache": torch.zeros(3, 2, 16, 4)},
                       "the cache's head dim is 4, q's is 8"),
    "kv heads": ({"k_cache": torch.zeros(3, 3, 16, 8), "v_cache": torch.zeros(3, 3, 16, 8)},
                 "4 query heads are not a multiple of 3 kv heads"),
    "q dtype": ({"q": torch.zeros(2, 4, 8, dtype=torch.float16)}, "use one dtype"),
    "fp8 k alone": ({"k_cache": torch.zeros(3, 2, 16, 8, dtype=FP8_CACHE_DTYPE)}, "use one dtype"),
    "e5m2 caches": ({"k_cache": torch.zeros(3, 2, 16, 8, dtype=torch.float8_e5m2),
                     "v_cache": torch.zeros(3, 2, 16, 8, dtype=torch.float8_e5m2)}, "use one dtype"),
    "head dim too wide": ({"max_head_dim": 4}, "head dim 8 exceeds the Triton kernel's 4: use backend='torch'"),
    "strided cache": ({"k_cache": torch.zeros(3, 2, 8, 16).transpose(2, 3), "v_cache": torch.zeros(3, 2, 16, 8)},
                      "k_cache must have unit stride along the head dim"),
    "cache rows": ({"k_cache": torch.zeros(1, 2, 16, 8), "v_cache": torch.zeros(1, 2, 16, 8)}, "the cache has 1 rows, q has 2"),
    "out shape": ({"out": torch.zeros(2, 4, 4)}, r"out must be \(2, 4, 8\) torch.float32"),
    "lengths dtype": ({"lengths": torch.tensor([5.0, 16.0])}, r"lengths must be \[2\] int32/int64"),
    "lengths strided": ({"lengths": torch.zeros(4, dtype=torch.int64)[::2]}, "lengths must be contiguous"),
    "devices": ({"lengths": torch.tensor([5, 16], device="meta")}, "all tensors must be on one device"),
    "table dtype": ({"block_tables": torch.zeros(2, 4, dtype=torch.int64)}, r"contiguous 2-D \[R, M\] int32"),
    "table rows": ({"block_tables": torch.zeros(1, 4, dtype=torch.int32)}, "the block table has 1 rows, q has 2"),
    "table device": ({"block_tables": torch.zeros(2, 4, dtype=torch.int32, device="meta")}, "block_tables is on meta"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_check_decode_attention_names_what_is_wrong(case: str) -> None:
    change, message = BAD_DECODE[case]
    with pytest.raises(ValueError, match=message):
        check_decode_attention(**_decode_args(**change))


def test_check_prefill_attention() -> None:
    q, cache = torch.zeros(7, 4, 8), torch.zeros(3, 2, 16, 8)
    metadata = [torch.tensor([0, 2]), torch.tensor([0, 5]), torch.tensor([0, 3]), torch.tensor([3, 4])]
    check_prefill_attention(q, cache, cache, *metadata)
    check_prefill_attention(q, torch.zeros(6, 2, 4, 8), torch.zeros(6, 2, 4, 8), *metadata,
                            block_tables=torch.zeros(3, 4, dtype=torch.int32))
    for index, bad in [(0, metadata[0].int()), (1, metadata[1][None]), (3, torch.tensor([3, 4, 0]))]:
        name = ("job_rows", "job_starts", "q_offsets", "q_lens")[index]
        args = list(metadata)
        args[index] = bad
        with pytest.raises(ValueError, match=f"q_lens must be 1-D int64 of one length, got {name}"):
            check_prefill_attention(q, cache, cache, *args)
    with pytest.raises(ValueError, match=r"q must be \[T, H, d\]"):
        check_prefill_attention(q[0], cache, cache, *metadata)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        check_prefill_attention(q, cache, cache, *metadata[:3], metadata[3].to("meta"))


def test_check_attention_head_dim() -> None:
    q, cache = torch.zeros(2, 4, 8), torch.zeros(3, 2, 16, 8)
    check_attention_head_dim(q, cache, cache, 8)
    with pytest.raises(ValueError, match="head dim 8 exceeds the Triton kernel's 4"):
        check_attention_head_dim(q, cache, cache, 4)
    with pytest.raises(ValueError, match="q must have unit stride along the head dim"):
        check_attention_head_dim(torch.zeros(2, 8, 4).transpose(1, 2), cache, cache, 8)
    with pytest.raises(ValueError, match="v_cache must have unit stride along the head dim"):
        check_attention_head_dim(q, cache, torch.zeros(3, 2, 8, 16).transpose(2, 3), 8)
    column = torch.zeros(2, 1, 4).transpose(1, 2)  # head dim 1: its stride does not matter
    check_attention_head_dim(column, torch.zeros(3, 2, 16, 1), torch.zeros(3, 2, 16, 1), 8)


def test_check_rows_op() -> None:
    x = torch.zeros(3, 16)[:, :8]  # any row stride
    check_rows_op("x", x, 8, None)
    check_rows_op("x", x, 8, torch.zeros(3, 8))
    for bad_x, width, message in [
        (x, 7, r"x must be a float \[N, 7\] tensor"),
        (torch.zeros(3, 16)[:, ::2], 8, "with unit column stride"),
        (torch.zeros(3, 8, dtype=torch.int32), 8, r"x must be a float \[N, 8\] tensor"),
        (torch.zeros(3, 8, 1), 8, r"x must be a float \[N, 8\] tensor"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_rows_op("x", bad_x, width, None)
    for residual in (torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.float64), torch.zeros(8, 3).t()):
        with pytest.raises(ValueError, match="residual must have unit column stride, x's shape"):
            check_rows_op("x", x, 8, residual)


def test_check_silu_mul() -> None:
    check_silu_mul(torch.zeros(2, 4), torch.zeros(2, 4))
    for up in (torch.zeros(2, 5), torch.zeros(4, 2), torch.zeros(2, 4, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="silu_mul needs gate and up of one shape and dtype"):
            check_silu_mul(torch.zeros(2, 4), up)


def test_check_chosen_logprobs() -> None:
    logits, targets = torch.zeros(3, 10), torch.zeros(3, dtype=torch.int64)
    check_chosen_logprobs(logits, targets)
    check_chosen_logprobs(torch.zeros(3, 16)[:, :10], targets)  # any row stride
    for bad in (torch.zeros(30), torch.zeros(10, 3).t()):
        with pytest.raises(ValueError, match=r"needs logits \[N, V\] with unit column stride"):
            check_chosen_logprobs(bad, targets)
    for bad in (targets.int(), targets[:2], targets.to("meta")):
        with pytest.raises(ValueError, match=r"needs int64 targets \[3\] on cpu"):
            check_chosen_logprobs(logits, bad)


def test_check_frozen_base() -> None:
    weight, bias = torch.zeros(3, 4), torch.zeros(3)
    check_frozen_base(weight, bias)
    check_frozen_base(weight, None)
    for base in ((weight.clone().requires_grad_(), None), (weight, bias.clone().requires_grad_())):
        with pytest.raises(ValueError, match=r"the base layer must be frozen \(requires_grad=False\)"):
            check_frozen_base(*base)
