"""Multi-LoRA ops and decode attention (installed as ``skyrl_clora.kernels``): one dispatch over pure-torch
references and Triton kernels. Layers call only ``add_lora`` and ``packed_lora``, the sampling engine
``decode_attention``; the dispatch picks the implementation by device. ``LoRAMeta`` (the per-step row
grouping) and ``DecodeWorkspace`` (attention partials) are preallocated buffers, for CUDA graphs. This
package imports nothing from the rest of the plugin.
"""

from skyrl_clora.kernels.attention import DecodeWorkspace
from skyrl_clora.kernels.dispatch import add_lora, decode_attention, packed_lora
from skyrl_clora.kernels.meta import LoRAMeta

__all__ = ["DecodeWorkspace", "LoRAMeta", "add_lora", "decode_attention", "packed_lora"]
