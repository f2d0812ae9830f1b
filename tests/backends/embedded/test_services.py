"""The embedded backend's shared services (skyrl_clora.backends.embedded.services), from the settings they are built
with: the trainer's slots per train mode, the base weights the sampler and the trainer's twin share (no copy) under
their own LoRA slots, the engine built beside the trainer with the CPU's choices where the sampler's settings are
null, and the train scheduler that pauses sampling only where asked (and on a GPU from ``pause_sampling_rows``
rows)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.backends.embedded.services import (
    Services,
    build_engine_beside_trainer,
    share_base_weights,
    trainer_slot_count,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).eval()


def _sampler(**settings: Any) -> SimpleNamespace:
    """``sampler.*`` as the config leaves it on the CPU (the nulls: chosen per device), with ``settings``."""
    defaults = dict(max_prefills_per_step=4, prefill_block=16, enable_prefix_caching=True, cuda_graphs=True,
                    reuse_decode_kv=None, stream_priority="normal", prefill_wait_steps=None, admission="fair",
                    reserve_kv=False, adapter_slots=None, kv_cache_dtype="auto")
    return SimpleNamespace(**(defaults | settings))


@pytest.mark.parametrize(("train_mode", "pack_size", "tenants", "slots"), [
    ("packed", 0, 3, 3), ("packed", 0, 12, 8), ("packed", 5, 12, 5), ("packed", 5, 2, 2),
    ("swap", 0, 1, 1), ("swap", 4, 2, 2), ("swap", 0, 7, 2),
])
def test_the_trainer_has_a_slot_per_packed_tenant_or_two_to_swap(train_mode: str, pack_size: int, tenants: int,
                                                                slots: int) -> None:
    run = SimpleNamespace(train_mode=train_mode, trainer=SimpleNamespace(pack_size=pack_size))
    assert trainer_slot_count(run, tenants) == slots


def test_the_trainers_twin_shares_the_samplers_base_weights_under_slots_of_its_own() -> None:
    model = _tiny_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    sampler_layers, twin, routing, trainer_layers = share_base_weights(model, sampler_slots=3, trainer_slots=2,
                                                                       max_rank=4)
    assert twin is not model and twin.training and len(sampler_layers) == len(trainer_layers) == 2 * 7
    path = "model.layers.1.self_attn.k_proj"
    assert sampler_layers[path].lora_a.shape == (3, 4, 32) and trainer_layers[path].lora_a.shape == (2, 4, 32)
    assert not any(p.requires_grad for p in sampler_layers[path].parameters())
    assert trainer_layers[path].lora_a.requires_grad
    for name in ("model.embed_tokens", "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.k_proj",
                 "model.layers.1.mlp.down_proj"):
        ours, theirs = model.get_submodule(name), twin.get_submodule(name)
        ours, theirs = getattr(ours, "base", ours), getattr(theirs, "base", theirs)
        assert ours.weight.data_ptr() == theirs.weight.data_ptr(), name
        assert torch.equal(theirs.weight, before[f"{name}.weight"]), name
    assert twin.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied, as the model"
    rotary = model.model.rotary_emb.inv_freq
    assert twin.model.rotary_emb.inv_freq.data_ptr() == rotary.data_ptr(), "non-persistent buffers shared too"
    assert all(not p.requires_grad for name, p in twin.named_parameters() if "lora" not in name)


def test_the_engine_beside_the_trainer_takes_the_sampler_settings_and_the_cpus_choices_for_the_nulls() -> None:
    model = _tiny_model()
    sampler_layers, _, _, _ = share_base_weights(model, sampler_slots=2, trainer_slots=1, max_rank=4)
    for reuse, expected_reuse in ((None, False), (True, True)):
        run = SimpleNamespace(sampler=_sampler(reuse_decode_kv=reuse), trainer=SimpleNamespace(sm_carveout=8))
        thread = build_engine_beside_trainer(run, model, sampler_layers, CPU, rows=16, max_len=40, kv_blocks=30)
        try:
            config = thread.engine.config
            assert (config.num_rows, config.max_len, config.num_blocks, config.block_size) == (16, 40, 30, 16)
            assert (config.max_prefills_per_step, config.stream_priority, config.admission) == (4, "normal", "fair")
            assert config.cache_prefixes and config.cuda_graphs and not config.reserve_kv
            assert (config.reuse_decode_kv, config.share_prefix_reads, config.prefill_wait_steps) == (
                expected_reuse, False, 0)
            assert thread.engine.adapters.count == 2 and thread.max_len == 48
        finally:
            thread.shutdown()


def _services(device: torch.device) -> Services:
    engine = SimpleNamespace(shutdowns=0)
    engine.shutdown = lambda: setattr(engine, "shutdowns", engine.shutdowns + 1)
    return Services(model_path="m", tokenizer=None, engine=engine, client=None,
                    trainer=SimpleNamespace(device=device), store=None, sync=None, cold_start_seconds=1.0)


@pytest.mark.parametrize(("device", "overlap", "pauses_for_rows"), [
    (CPU, None, None), (CPU, True, None), (CPU, False, 0), (CUDA, None, 48), (CUDA, True, None), (CUDA, False, 0),
])
def test_sampling_is_paused_for_training_passes_only_where_asked(device: torch.device, overlap: bool | None,
                                                                 pauses_for_rows: int | None) -> None:
    """Null overlaps on the CPU (where the trainer and the engine each keep a core busy) and pauses on a GPU while
    ``pause_sampling_rows`` rows decode; true never pauses, false pauses for every pass."""
    services = _services(device)
    trainer = SimpleNamespace(overlap_sampling=overlap, pack_policy="lockstep", train_priority="fewest_updates",
                              pause_sampling_rows=48)
    scheduler = services.train_scheduler(SimpleNamespace(trainer=trainer, train_mode="packed"))
    assert (scheduler.mode, scheduler.lockstep, scheduler.priority) == ("packed", True, "fewest_updates")
    assert scheduler.trainer is services.trainer
    if pauses_for_rows is None:
        assert scheduler.sampler is None
    else:
        assert scheduler.sampler is services.engine and scheduler.pause_rows == pauses_for_rows
    services.shutdown()
    assert services.engine.shutdowns == 1
