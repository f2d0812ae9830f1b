"""A module of two LoRA targets of different shapes (``q_proj`` 6 -> 4, ``v_proj`` 4 -> ``v_out``) for the unit tests
of what holds or stores a tenant's LoRA state (``trainer/test_adapter_store.py``, ``trainer/test_optim.py``,
``trainer/test_state_io.py``, ``lora/test_peft_export.py``): multi-LoRA layers of a few dozen values, no model needed."""

from __future__ import annotations

from torch import nn

from skyrl_clora.lora.layers import MultiLoRALinear, attach_multi_lora


class TwoProjections(nn.Module):
    def __init__(self, v_out: int = 5) -> None:
        super().__init__()
        self.q_proj = nn.Linear(6, 4)
        self.v_proj = nn.Linear(4, v_out)


def two_projection_layers(slots: int = 2, max_rank: int = 4, trainable: bool = True,
                          v_out: int = 5) -> dict[str, MultiLoRALinear]:
    """The multi-LoRA layers ``{"q_proj", "v_proj"}`` of a :class:`TwoProjections`."""
    return attach_multi_lora(TwoProjections(v_out), num_slots=slots, max_rank=max_rank, trainable=trainable)[1]
