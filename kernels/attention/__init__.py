"""Attention straight from the sampling engine's KV cache: one query token per row (``decode``) and ragged
prefill passes (``prefill``). Callers go through ``skyrl_clora.kernels.dispatch``."""
