"""Adapter initialisation and PEFT-format save/load.

PEFT names a LoRA weight ``base_model.model.<module path>.lora_A.weight`` (``[r, H_in]``) and
``...lora_B.weight`` (``[H_out, r]``), beside an ``adapter_config.json``; ``peft.PeftModel.from_pretrained``
loads that folder onto the base model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear

_PREFIX = "base_model.model."


def init_adapter(
    layers: dict[str, MultiLoRALinear], rank: int, alpha: float, generator: torch.Generator
) -> AdapterWeights:
    """PEFT's default LoRA init in fp32: ``A ~ kaiming_uniform(a=sqrt(5))`` (i.e. U(-1/sqrt(H_in), 1/sqrt(H_in))),
    ``B = 0``, so a fresh adapter leaves the base model's output unchanged."""
    adapter = AdapterWeights(rank=rank, alpha=alpha)
    for path, layer in layers.items():
        bound = 1.0 / math.sqrt(layer.in_features)
        a = torch.rand(rank, layer.in_features, generator=generator, dtype=torch.float32) * (2 * bound) - bound
        adapter.a[path] = a
        adapter.b[path] = torch.zeros(layer.out_features, rank, dtype=torch.float32)
    return adapter


def save_peft_adapter(adapter: AdapterWeights, out_dir: Path, base_model_path: str) -> None:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` that ``peft`` loads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in adapter.a:
        tensors[f"{_PREFIX}{path}.lora_A.weight"] = adapter.a[path].detach().float().contiguous().cpu()
        tensors[f"{_PREFIX}{path}.lora_B.weight"] = adapter.b[path].detach().float().contiguous().cpu()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    target_modules = sorted({path.rsplit(".", 1)[-1] for path in adapter.a})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": target_modules,
        "inference_mode": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_peft_adapter(adapter_dir: Path) -> AdapterWeights:
    """Reads a PEFT LoRA folder (as written by :func:`save_peft_adapter` or by PEFT itself)."""
    config_path = adapter_dir / "adapter_config.json"
    weights_path = adapter_dir / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{adapter_dir} is not a PEFT adapter folder (needs adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_path.read_text())
    adapter = AdapterWeights(rank=int(config["r"]), alpha=float(config["lora_alpha"]))
    for name, tensor in load_file(str(weights_path)).items():
        path = name.removeprefix(_PREFIX)
        if path.endswith(".lora_A.weight"):
            adapter.a[path.removesuffix(".lora_A.weight")] = tensor
        elif path.endswith(".lora_B.weight"):
            adapter.b[path.removesuffix(".lora_B.weight")] = tensor
    return adapter
