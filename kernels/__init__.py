"""Multi-LoRA ops (installed as ``skyrl_clora.kernels``): one dispatch over a pure-torch reference and
Triton kernels. Layers call only the functions exported here; the dispatch picks the implementation
by device. This package imports nothing from the rest of the plugin.
"""

from skyrl_clora.kernels.dispatch import add_lora, packed_lora

__all__ = ["add_lora", "packed_lora"]
