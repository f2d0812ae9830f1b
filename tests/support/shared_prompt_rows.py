"""A micro model with two different tenants' adapters and rows that share prompts, for the tests of the trainer's
shared-prompt forwards (``trainer/test_prompt_segments.py`` and ``trainer/test_shared_prefix.py``), which compare
them against every row running its whole sequence."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import LoRARouting, MultiLoRALinear, attach_multi_lora, write_slot
from skyrl_clora.lora.peft_export import init_adapter


def two_tenant_model(model_dir: Path) -> tuple[torch.nn.Module, LoRARouting, dict[str, MultiLoRALinear]]:
    """The micro model in training mode with two slots of rank 8, each a different adapter (random non-zero B)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    routing, layers = attach_multi_lora(model, num_slots=2, max_rank=8, trainable=True)
    for slot in range(2):
        adapter = init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(slot))
        for path in adapter.b:  # B = 0 would leave the base model's output unchanged: tenants must differ
            adapter.b[path] = torch.randn(adapter.b[path].shape, generator=torch.Generator().manual_seed(slot + 7)) * 0.1
        write_slot(layers, slot, adapter)
    return model, routing, layers


def shared_prompt_rows() -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
    """Three prompts of different lengths with 3, 1 and 2 samples; prompt 1 and 2 in slot 1, prompt 0 in slot 0."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (length,), generator=generator).tolist() for length in (7, 12, 5)]
    prefix_of = [0, 0, 0, 1, 2, 2]
    responses = [torch.randint(0, 300, (length,), generator=generator).tolist() for length in (4, 9, 1, 6, 3, 8)]
    return [prompts[p] for p in prefix_of], responses, prefix_of, [0 if p == 0 else 1 for p in prefix_of]
