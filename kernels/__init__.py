"""Multi-LoRA ops (installed as ``skyrl_clora.kernels``): one dispatch over a pure-torch reference and
Triton kernels. Layers call only ``add_lora`` and ``packed_lora``; the dispatch picks the implementation
by device. ``LoRAMeta`` holds the per-step row grouping in preallocated buffers (for CUDA graphs). This
package imports nothing from the rest of the plugin.
"""

from skyrl_clora.kernels.dispatch import add_lora, packed_lora
from skyrl_clora.kernels.meta import LoRAMeta

__all__ = ["LoRAMeta", "add_lora", "packed_lora"]
