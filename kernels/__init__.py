"""Multi-LoRA ops, decode and prefill attention, fused layer ops and token sampling (installed as
``skyrl_clora.kernels``): one dispatch over pure-torch references and Triton kernels. Layers call only
``add_lora``, ``lora_linear`` (a frozen linear layer plus ``packed_lora``) and ``dense_lora_linear`` (one slot
for every row); the sampling engine calls ``folded_qkv_rope_into_cache`` and ``folded_lora_linear`` (its
layers' LoRA A folded into the base weight), ``decode_attention``, ``prefill_attention``, ``rms_norm`` and
``silu_mul``; the trainer calls ``rms_norm_with_grad``, ``silu_mul_with_grad``, ``rope_with_grad``,
``gather_rows`` (shared-prompt attention's keys) and, for its LM-head loss, ``chosen_logprobs_``; the sampler
calls ``sample_tokens``; the dispatch picks the implementation by device. ``LoRAMeta`` (the per-step row
grouping) and ``DecodeWorkspace`` (attention partials) are preallocated buffers, for CUDA graphs. This package
imports nothing from the rest of the plugin.
"""

from skyrl_clora.kernels.attention.decode import DecodeWorkspace
from skyrl_clora.kernels.checks import FP8_CACHE_DTYPE
from skyrl_clora.kernels.dispatch import (
    add_lora,
    chosen_logprobs_,
    decode_attention,
    dense_lora_linear,
    folded_lora_linear,
    gather_rows,
    lora_linear,
    packed_lora,
    prefill_attention,
    qk_norm_rope,
    rms_norm,
    rms_norm_with_grad,
    rope_with_grad,
    sample_tokens,
    silu_mul,
    silu_mul_with_grad,
)
from skyrl_clora.kernels.lora.folded import FoldedWeights, fold_lora_weights
from skyrl_clora.kernels.lora.meta import LoRAMeta
from skyrl_clora.kernels.qkv_dispatch import folded_qkv_rope, folded_qkv_rope_into_cache
from skyrl_clora.kernels.lora.qkv_rope import KVCacheWrite

__all__ = [
    "DecodeWorkspace", "FP8_CACHE_DTYPE", "FoldedWeights", "KVCacheWrite", "LoRAMeta", "add_lora", "chosen_logprobs_",
    "decode_attention", "dense_lora_linear", "fold_lora_weights", "folded_lora_linear", "folded_qkv_rope",
    "folded_qkv_rope_into_cache", "gather_rows", "lora_linear", "packed_lora", "prefill_attention", "qk_norm_rope",
    "rms_norm", "rms_norm_with_grad", "rope_with_grad", "sample_tokens", "silu_mul", "silu_mul_with_grad",
]
