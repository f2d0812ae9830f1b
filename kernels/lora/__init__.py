"""Multi-LoRA ops: the per-step row grouping (``meta``), the segmented shrink/expand (``sgmv``), LoRA A folded
into the base GEMM (``folded``), the fused q/k/v expand with norm and rotary (``qkv_rope``), one slot for every
row (``dense_lora``) and packed training (``packed``). Callers go through ``skyrl_clora.kernels.dispatch``."""
