"""The GPU specialisations of the kernels that read or write the K/V cache, compiled for an sm_90 (Hopper) target
without a GPU: Triton's front end, its MLIR passes and the bundled ptxas, none of which the CPU interpreter
(``TRITON_INTERPRET=1``) runs, so a kernel the interpreter runs can still fail to compile for the GPU.

Each :class:`KernelCase` is one launch of the engine on the GPU, written out: the pointer dtypes, the constexprs
and the compile options the launcher passes there (``device.type == "cuda"``: ``UPCAST`` / ``INTERPRETED``
False, PDL where the launcher turns it on for sm_90), with the cache in the model dtype (bf16) or fp8
(``*fp8e4nv``). Shapes: Qwen3-4B's attention (32 query heads, 8 kv heads, head dim 128, hidden 2560), LoRA rank
16 in 8 slots, and the sampler's default config (``conf/config.yaml``: 32-position KV blocks, 16 prefills per
step) with caches of 2,048 positions.

Run as a script, in an environment without ``TRITON_INTERPRET`` (the kernels must be ``JITFunction`` objects,
not interpreted ones): ``python tests/support/sm90_compile.py [CASE ...]`` compiles the named cases (all by default)
and prints one JSON line per case, ``{"case": name, "error": null or the compiler's message}``; exits 1 if any
case failed. ``tests/support/sm90_compile_runs.py`` runs it in a subprocess for the kernels' tests.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from skyrl_clora.kernels.attention.decode import (
    _MAX_QUERY_TILE,
    PREFIX_GROUP_ROWS,
    _register_cap,
    default_attention_config,
)
from skyrl_clora.kernels.attention.prefill import default_prefill_config
from skyrl_clora.kernels.launch import next_power_of_2
from skyrl_clora.kernels.lora.meta import rank_pad
from skyrl_clora.kernels.lora.sgmv import default_config

TARGET = GPUTarget("cuda", 90, 32)  # the H200: sm_90, 32-thread warps
CACHE_DTYPES = ("bf16", "fp8e4nv")  # the model dtype's cache and the fp8 one (FP8_CACHE_DTYPE, float8_e4m3fn)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2560, 32, 8, 128  # Qwen3-4B
RANK, SLOTS = 16, 8
BLOCK_SIZE = 32  # conf/config.yaml sampler.prefill_block
PREFILL_TOKENS = 16 * BLOCK_SIZE  # sampler.max_prefills_per_step blocks (engine.py: prefill_tokens)
PREFILL_JOBS = PREFILL_TOKENS // BLOCK_SIZE  # ModelRunner.max_prefill_jobs
DECODE_ROWS = 256
MAX_LEN = 2048


@dataclass(frozen=True)
class KernelCase:
    """One GPU specialisation of ``module.kernel``: ``pointers`` maps every pointer parameter to its Triton
    type (``"*bf16"``, ``"*fp8e4nv"``, ...), ``constexprs`` every constexpr parameter to its value, ``floats``
    names the fp32 scalars; every other parameter is an i32 scalar, unspecialised (a launch marks the integers
    divisible by 16, which changes the generated code, e.g. vectorised loads, but not what the front end accepts).
    ``options``: the launch's compile options (``num_warps`` ...; what a launch leaves out takes Triton's default,
    as there)."""

    name: str
    module: str
    kernel: str
    pointers: Mapping[str, str]
    constexprs: Mapping[str, object]
    floats: Collection[str]
    options: Mapping[str, int]


def signature(kernel: JITFunction, pointers: Mapping[str, str], constexprs: Mapping[str, object],
              floats: Collection[str]) -> dict[str, str]:
    """The kernel's signature for ``ASTSource``: ``"constexpr"``, a pointer type, ``"fp32"`` or ``"i32"`` per
    parameter. Raises ValueError on a name that is not a parameter, a constexpr without a value or a
    ``*_ptr`` parameter without a type (a kernel's parameters changed and the case did not follow)."""
    names = [param.name for param in kernel.params]
    unknown = (set(pointers) | set(constexprs) | set(floats)) - set(names)
    if unknown:
        raise ValueError(f"{kernel.__name__} has no parameters {sorted(unknown)}")
    result = {}
    for param in kernel.params:
        if param.is_constexpr:
            if param.name not in constexprs:
                raise ValueError(f"{kernel.__name__}'s constexpr {param.name} has no value")
            result[param.name] = "constexpr"
        elif param.name in pointers:
            result[param.name] = pointers[param.name]
        elif param.name.endswith("_ptr"):
            raise ValueError(f"{kernel.__name__}'s pointer {param.name} has no type")
        else:
            result[param.name] = "fp32" if param.name in floats else "i32"
    return result


def compile_case(case: KernelCase) -> None:
    """Compiles ``case`` for :data:`TARGET` through ptxas; raises what the compiler raises."""
    kernel = getattr(importlib.import_module(case.module), case.kernel)
    if not isinstance(kernel, JITFunction):
        raise TypeError(f"{case.module}.{case.kernel} is not a JITFunction but {type(kernel).__name__}: the module "
                        "was imported with TRITON_INTERPRET=1")
    sig = signature(kernel, case.pointers, case.constexprs, case.floats)
    names = list(sig)
    constexprs = {(names.index(name),): value for name, value in case.constexprs.items()}
    # Pointers 16-byte aligned, as a launch specialises torch's allocations.
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in case.pointers}
    source = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    triton.compile(source, target=TARGET, options=dict(case.options))


def qkv_rope_cases() -> list[KernelCase]:
    """``_qkv_rope_kernel`` as ``folded_qkv_rope_triton`` launches it: q/k/v of Qwen3-4B with q/k norm, at decode
    (``DECODE_ROWS`` rows: the folded GEMM's bf16 partial sums, one split, PDL) and at prefill (``PREFILL_TOKENS``
    rows: ``sgmv_shrink``'s fp32 split-K partials; the split count is ``default_config``'s, which
    ``shrink_workspace`` may trim to whole K tiles); k and v into the cache (``TO_CACHE``, the engine's
    ``folded_qkv_rope_into_cache``) of either dtype, or into new tensors of the model dtype."""
    cases = []
    for pass_name, rows, folded in (("decode", DECODE_ROWS, True), ("prefill", PREFILL_TOKENS, False)):
        config = default_config(rows, HIDDEN, SLOTS, 3, RANK)
        for kv in (*CACHE_DTYPES, None):  # None: new k and v tensors (TO_CACHE False), in the model dtype
            pointers = {
                "y_ptr": "*bf16", "ws_ptr": "*bf16" if folded else "*fp32", "bq_ptr": "*bf16", "bk_ptr": "*bf16",
                "bv_ptr": "*bf16", "scale_ptr": "*fp32", "sorted_ptr": "*i32", "count_ptr": "*i32",
                "cos_ptr": "*bf16", "sin_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "q_out_ptr": "*bf16",
                "k_out_ptr": f"*{kv or 'bf16'}", "v_out_ptr": f"*{kv or 'bf16'}",
                # KVCacheWrite's int64 rows and positions; without a cache the launcher passes q (not read)
                "cache_row_ptr": "*i64" if kv else "*bf16", "cache_pos_ptr": "*i64" if kv else "*bf16",
            }  # fmt: skip
            constexprs = {
                "S_P2": next_power_of_2(SLOTS), "BLOCK_M": config.block_m, "BLOCK_R": rank_pad(RANK), "D": HEAD_DIM,
                "SPLIT_K": 1 if folded else config.split_k, "A_PER_SLICE": True, "HAS_NORM": True,
                "UPCAST": False, "DOT_PRECISION": "tf32", "TO_CACHE": kv is not None, "PDL": config.pdl,
            }  # fmt: skip
            kv_name = f"{kv}_cache" if kv else "new_kv"
            cases.append(KernelCase(f"qkv_rope-{pass_name}-{kv_name}", "skyrl_clora.kernels.lora.qkv_rope",
                                    "_qkv_rope_kernel", pointers, constexprs, floats=("eps",),
                                    options={"num_warps": 4}))
    return cases


def decode_partial_cases() -> list[KernelCase]:
    """``_partial_kernel`` as ``decode_attention_triton`` launches it for ``DECODE_ROWS`` rows (the engine's
    int64 lengths and prefix tensors), paged (the engine's layout) or slot, with or without shared prefixes,
    under ``default_attention_config`` (PDL on sm_90, the register cap with prefixes)."""
    config = default_attention_config(MAX_LEN)
    group = HEADS // KV_HEADS
    block_d = max(16, next_power_of_2(HEAD_DIM))
    cases = []
    for kv in CACHE_DTYPES:
        for paged in (True, False):
            for has_prefix in (True, False):
                members = max(1, min(PREFIX_GROUP_ROWS, _MAX_QUERY_TILE // group)) if has_prefix else 1
                pointers = {
                    "q_ptr": "*bf16", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "table_ptr": "*i32" if paged else "*i64",
                    "len_ptr": "*i64", "prefix_row_ptr": "*i64", "prefix_len_ptr": "*i64", "served_ptr": "*i32",
                    "count_ptr": "*i32", "members_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32",
                }  # fmt: skip
                constexprs = {
                    "GROUP": group, "MEMBERS": members, "BLOCK_Q": max(16, next_power_of_2(group * members)),
                    "BLOCK_D": block_d, "BLOCK_N": config.block_n, "SPLIT_LEN": config.split_len, "UPCAST": False,
                    "DOT_PRECISION": "tf32", "PDL": config.pdl, "HAS_PREFIX": has_prefix, "PAGED": paged,
                    "BLOCK_SIZE": BLOCK_SIZE if paged else 1,
                }  # fmt: skip
                options = {"num_warps": config.num_warps, "num_stages": config.num_stages,
                           **_register_cap(config, has_prefix, block_d, on_cpu=False)}
                name = f"decode_partials-{'paged' if paged else 'slot'}-{'prefix' if has_prefix else 'no_prefix'}"
                cases.append(KernelCase(f"{name}-{kv}_cache", "skyrl_clora.kernels.attention.decode", "_partial_kernel",
                                        pointers, constexprs, floats=("qk_scale",), options=options))
    return cases


def prefill_cases() -> list[KernelCase]:
    """``_prefill_kernel`` as ``prefill_attention_triton`` launches it for a pass of ``PREFILL_JOBS`` jobs (the
    engine's int64 job metadata), paged (the engine's layout) or slot, under ``default_prefill_config``."""
    groups = HEADS // KV_HEADS
    config = default_prefill_config(groups)
    cases = []
    for kv in CACHE_DTYPES:
        for paged in (True, False):
            pointers = {
                "q_ptr": "*bf16", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}", "table_ptr": "*i32" if paged else "*i64",
                "out_ptr": "*bf16", "rows_ptr": "*i64", "starts_ptr": "*i64", "offsets_ptr": "*i64", "lens_ptr": "*i64",
            }  # fmt: skip
            constexprs = {
                "GROUPS": groups, "HEAD_DIM": HEAD_DIM, "BLOCK_Q": config.block_q,
                "BLOCK_M": next_power_of_2(config.block_q * groups), "BLOCK_N": config.block_n,
                "BLOCK_D": max(16, next_power_of_2(HEAD_DIM)), "BLOCK_J": next_power_of_2(PREFILL_JOBS),
                "INTERPRETED": False, "DOT_PRECISION": "tf32", "PAGED": paged, "BLOCK_SIZE": BLOCK_SIZE if paged else 1,
            }  # fmt: skip
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            cases.append(KernelCase(f"prefill_attention-{'paged' if paged else 'slot'}-{kv}_cache",
                                    "skyrl_clora.kernels.attention.prefill", "_prefill_kernel", pointers, constexprs,
                                    floats=("qk_scale",), options=options))
    return cases


CASES: dict[str, KernelCase] = {case.name: case for case in qkv_rope_cases() + decode_partial_cases() + prefill_cases()}


def main(names: list[str]) -> int:
    """Compiles the cases ``names`` (all if empty), printing one JSON line per case; 1 if any failed."""
    failed = False
    for name in names or list(CASES):
        try:
            compile_case(CASES[name])
            error = None
        except Exception as exc:  # noqa: BLE001 - reported per case, with the compiler's message
            error = f"{type(exc).__name__}: {exc}"
            failed = True
        print(json.dumps({"case": name, "error": error}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
