"""Multi-LoRA model: a tenant's output in a mixed batch equals its output alone and equals PEFT's."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora, read_slot, write_slot
from skyrl_clora.lora.peft_export import load_peft_adapter, save_peft_adapter

from tests.support.helpers import random_adapter


@pytest.fixture
def multi_lora(micro_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    routing, layers = attach_multi_lora(model, num_slots=3, max_rank=16, trainable=False)
    adapters = [random_adapter(layers, seed, rank, 2.0 * rank, b_std=0.2) for seed, rank in enumerate((8, 16, 4))]
    for slot, adapter in enumerate(adapters):
        write_slot(layers, slot, adapter)
    return model, routing, layers, adapters


def _logits(model, routing, ids: torch.Tensor, slots_per_row: list[int]) -> torch.Tensor:
    token_slots = torch.tensor(slots_per_row).repeat_interleave(ids.shape[1])
    with routing.route(token_slots), torch.no_grad():
        return model(input_ids=ids).logits


def test_mixed_batch_equals_each_tenant_alone(multi_lora) -> None:
    model, routing, _, _ = multi_lora
    ids = torch.randint(0, 300, (4, 10), generator=torch.Generator().manual_seed(1))
    ids[:] = ids[0]  # the same prompt in every row: differences can only come from the adapters
    slots = [0, 1, -1, 2]
    mixed = _logits(model, routing, ids, slots)
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.allclose(mixed[a], mixed[b], atol=1e-3), "tenants' outputs must differ"
    for row, slot in enumerate(slots):
        alone = _logits(model, routing, ids[row : row + 1], [slot])
        torch.testing.assert_close(mixed[row], alone[0], rtol=1e-5, atol=1e-5)


def test_rows_without_adapter_are_the_base_model(micro_model_dir: Path, multi_lora) -> None:
    model, routing, _, _ = multi_lora
    base = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    torch.testing.assert_close(_logits(model, routing, ids, [-1, -1]), expected, rtol=1e-5, atol=1e-5)
    with routing.route(None), torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_equals_peft_for_the_same_weights(micro_model_dir: Path, multi_lora, tmp_path: Path) -> None:
    model, routing, layers, adapters = multi_lora
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    ours = [_logits(model, routing, ids, [slot])[0] for slot in range(3)]
    assert not torch.allclose(ours[0], ours[1], atol=1e-3), "adapters' outputs must differ"
    for slot, adapter in enumerate(adapters):
        save_peft_adapter(adapter, tmp_path / f"a{slot}", str(micro_model_dir))
        base = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
        peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path / f"a{slot}")).eval()
        with torch.no_grad():
            reference = peft_model(input_ids=ids).logits[0]
        torch.testing.assert_close(ours[slot], reference, rtol=1e-4, atol=1e-4)


def test_slot_write_read_and_peft_roundtrip(multi_lora, tmp_path: Path) -> None:
    _, _, layers, adapters = multi_lora
    back = read_slot(layers, 2, rank=4, alpha=8.0)
    for path in adapters[2].a:
        assert torch.equal(back.a[path], adapters[2].a[path])
        assert torch.equal(back.b[path], adapters[2].b[path])
    storage = {path: layer.lora_a.data_ptr() for path, layer in layers.items()}
    write_slot(layers, 2, adapters[0])  # rank 8 into a slot that held rank 4: in place, zero padded
    assert all(layer.lora_a.data_ptr() == storage[path] for path, layer in layers.items())
    first = next(iter(layers.values()))
    assert torch.count_nonzero(first.lora_a[2, 8:]) == 0
    save_peft_adapter(adapters[1], tmp_path / "adapter", "base")
    loaded = load_peft_adapter(tmp_path / "adapter")
    assert loaded.rank == 16 and loaded.alpha == 32.0
    assert all(torch.equal(loaded.a[p], adapters[1].a[p]) for p in adapters[1].a)


def test_attach_rejects_models_without_targets() -> None:
    with pytest.raises(ValueError, match="target_modules"):
        attach_multi_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1, 4, trainable=False)
