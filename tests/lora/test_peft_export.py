"""Adapter initialisation and the PEFT format (:mod:`skyrl_clora.lora.peft_export`): a fresh adapter is PEFT's default
init (``A`` uniform within ``1/sqrt(H_in)``, drawn from the generator; ``B`` zero) at each layer's shapes; a saved
adapter is a PEFT folder (PEFT's tensor names and ``adapter_config.json``) that reads back bit for bit; a folder
without both files is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from skyrl_clora.lora.peft_export import init_adapter, load_peft_adapter, save_peft_adapter
from tests.support.helpers import random_adapter
from tests.support.tiny_lora_layers import two_projection_layers


def test_a_fresh_adapter_is_pefts_default_init() -> None:
    layers = two_projection_layers(slots=1, max_rank=8, trainable=False)
    adapter = init_adapter(layers, 3, 6.0, torch.Generator().manual_seed(0))
    assert (adapter.rank, adapter.alpha, adapter.scale) == (3, 6.0, 2.0)
    for path, (fan_in, fan_out) in {"q_proj": (6, 4), "v_proj": (4, 5)}.items():
        a, b = adapter.a[path], adapter.b[path]
        assert a.shape == (3, fan_in) and a.dtype == torch.float32 and b.shape == (fan_out, 3)
        assert not b.any() and a.abs().max() <= 1 / math.sqrt(fan_in) and a.std() > 0
    again = init_adapter(layers, 3, 6.0, torch.Generator().manual_seed(0))
    other = init_adapter(layers, 3, 6.0, torch.Generator().manual_seed(1))
    assert torch.equal(again.a["q_proj"], adapter.a["q_proj"]) and not torch.equal(other.a["q_proj"], adapter.a["q_proj"])


def test_a_saved_adapter_is_a_peft_folder_that_reads_back_bit_for_bit(tmp_path: Path) -> None:
    layers = two_projection_layers(slots=1, max_rank=8, trainable=False)
    adapter = random_adapter(layers, seed=4, rank=2, alpha=5.0)
    save_peft_adapter(adapter, tmp_path / "out" / "adapter", "/models/base")
    folder = tmp_path / "out" / "adapter"
    assert sorted(load_file(str(folder / "adapter_model.safetensors"))) == [
        f"base_model.model.{path}.lora_{part}.weight" for path in ("q_proj", "v_proj") for part in "AB"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config == {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "/models/base", "r": 2,
                      "lora_alpha": 5.0, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                      "target_modules": ["q_proj", "v_proj"], "inference_mode": True}
    loaded = load_peft_adapter(folder)
    assert (loaded.rank, loaded.alpha) == (2, 5.0) and loaded.a.keys() == loaded.b.keys() == {"q_proj", "v_proj"}
    assert all(torch.equal(loaded.a[p], adapter.a[p]) and torch.equal(loaded.b[p], adapter.b[p]) for p in adapter.a)


def test_the_target_modules_are_the_layers_last_names(tmp_path: Path) -> None:
    layers = two_projection_layers(slots=1, max_rank=8, trainable=False)
    adapter = random_adapter(layers, seed=0, rank=2)
    adapter.a = {f"model.layers.{i}.self_attn.{p}": t.clone() for i in range(2) for p, t in adapter.a.items()}
    adapter.b = {f"model.layers.{i}.self_attn.{p}": t.clone() for i in range(2) for p, t in adapter.b.items()}
    save_peft_adapter(adapter, tmp_path, "base")
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    assert set(load_peft_adapter(tmp_path).a) == set(adapter.a)


def test_a_folder_without_both_files_is_refused(tmp_path: Path) -> None:
    save_peft_adapter(random_adapter(two_projection_layers(slots=1, trainable=False), seed=0, rank=2), tmp_path, "b")
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"is not a PEFT adapter folder \(needs adapter_config.json and "
                                         r"adapter_model.safetensors\)$"):
        load_peft_adapter(tmp_path)
