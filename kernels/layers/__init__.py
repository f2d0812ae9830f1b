"""Fused per-layer ops of a decoder: element-wise norm/rotary/SiLU (``layer_ops``), their training autograd
functions (``train_ops``), the trainer's gather with a segmented backward (``gather_ops``), the LM-head
log-prob loss (``logprob_ops``) and token sampling (``sampling``). Callers go through
``skyrl_clora.kernels.dispatch``."""
