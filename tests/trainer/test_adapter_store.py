"""The AdapterStore (:mod:`skyrl_clora.trainer.adapter_store`): a registered tenant's host state (masters, moments,
gradients, RNG, model-dtype weights), swaps through a device slot of a larger rank (zero-padded, scaled per
tenant, written back on swap-out, every table of both tenants through one slot) and the refusals that keep a
tenant in at most one slot and a slot to one tenant."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.trainer import Trainer
from tests.support.helpers import random_adapter
from tests.support.swap_trainer_fixture import trainer  # noqa: F401 - the fixture the tests take
from tests.support.tiny_lora_layers import two_projection_layers as _layers
from tests.support.transport import check_swap_a_b_a


def _store_with(rank: int = 2, alpha: float = 4.0, seed: int = 5) -> tuple[AdapterStore, AdapterWeights]:
    """A two-slot store of max rank 4 with tenant ``t`` (``rank``, ``alpha``, a random non-zero adapter)."""
    layers = _layers()
    store = AdapterStore(layers, num_slots=2)
    adapter = random_adapter(layers, seed=1, rank=rank, alpha=alpha)
    store.register("t", adapter, LRSchedule(1e-3), seed=seed)
    return store, adapter


def test_swap_a_b_a_moves_every_table_of_both_tenants(trainer: Trainer) -> None:
    check_swap_a_b_a(trainer)


def test_store_rejects_bad_registrations(trainer: Trainer) -> None:
    weights = init_adapter(trainer.layers, 32, 64.0, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="exceeds sampler.max_lora_rank"):
        trainer.store.register("C", weights, LRSchedule(base_lr=1e-3), seed=0)
    with pytest.raises(ValueError, match="already registered"):
        trainer.store.register("A", init_adapter(trainer.layers, 8, 16.0, torch.Generator()), LRSchedule(1e-3), seed=0)
    trainer.store.swap_in("A", 0)
    with pytest.raises(RuntimeError, match="still holds"):
        trainer.store.swap_in("B", 0)


def test_a_registered_tenant_starts_at_its_adapter_with_zero_moments_and_a_seeded_rng() -> None:
    store, adapter = _store_with(rank=2, alpha=4.0, seed=5)
    state = store.tenants["t"]
    assert (state.rank, state.scale, state.step, state.kl_coef) == (2, 2.0, 0, None)
    for path in ("q_proj", "v_proj"):
        assert torch.equal(state.master[f"{path}.a"], adapter.a[path])
        assert torch.equal(state.master[f"{path}.b"], adapter.b[path])
        assert torch.equal(state.weights.a[path], adapter.a[path]) and torch.equal(state.weights.b[path], adapter.b[path])
    assert all(not state.flat[table].any() for table in ("exp_avg", "exp_avg_sq", "grads"))
    assert torch.equal(state.rng_state, torch.Generator().manual_seed(5).get_state())
    # rank 2: q_proj A [2, 6] + B [4, 2], v_proj A [2, 4] + B [5, 2] = 38 values; 4 fp32 tables + fp32 weights
    assert state.flat["master"].numel() == 38 and store.host_bytes(2) == 38 * (4 * 4 + 4)


def test_swap_in_pads_to_the_slot_rank_and_swap_out_writes_the_slot_back() -> None:
    store, adapter = _store_with(rank=2, alpha=4.0)
    q = store.layers["q_proj"]
    with torch.no_grad():
        q.lora_a[1].fill_(7.0)  # what an earlier tenant of rank 4 left in the slot
        q.lora_b[1].fill_(7.0)
    state = store.swap_in("t", 1)
    assert store.slot_of("t") == 1 and q.scales[1] == 2.0 and q.scales[0] == 0.0
    assert torch.equal(q.lora_a[1, :2], adapter.a["q_proj"]) and not q.lora_a[1, 2:].any()
    assert torch.equal(q.lora_b[1, :, :2], adapter.b["q_proj"]) and not q.lora_b[1, :, 2:].any()
    assert not q.lora_a.grad[1].any()
    with torch.no_grad():  # what a step leaves in the slot: new masters, moments and gradients
        for view in store.table_views(1, "master"):
            view.add_(1.0)
        for view in store.table_views(1, "exp_avg"):
            view.fill_(0.5)
        q.lora_a.grad[1].fill_(3.0)
    assert store.swap_out(1) is state
    store.wait("t")
    assert store.slot_of("t") is None and q.scales[1] == 0.0
    assert torch.equal(state.master["q_proj.a"], adapter.a["q_proj"] + 1.0)
    assert torch.equal(state.weights.b["v_proj"], adapter.b["v_proj"] + 1.0)
    assert torch.equal(state.exp_avg["v_proj.b"], torch.full((5, 2), 0.5))
    assert torch.equal(state.grads["q_proj.a"], torch.full((2, 6), 3.0)) and not state.grads["v_proj.a"].any()


def test_a_released_prefetch_frees_the_slot_and_changes_nothing() -> None:
    store, adapter = _store_with()
    before = {table: flat.clone() for table, flat in store.tenants["t"].flat.items()}
    store.prefetch("t", 0)
    assert store.slot_of("t") == 0
    with pytest.raises(RuntimeError, match="already on the device"):
        store.prefetch("t", 1)
    store.release(0)
    assert store.slot_of("t") is None
    assert all(torch.equal(store.tenants["t"].flat[table], flat) for table, flat in before.items())
    store.swap_in("t", 0)
    with pytest.raises(RuntimeError, match="swapped in; swap it out"):
        store.release(0)


def test_the_store_refuses_what_would_break_its_slots() -> None:
    with pytest.raises(ValueError, match="needs trainable multi-LoRA layers"):
        AdapterStore(_layers(trainable=False), num_slots=1)
    with pytest.raises(ValueError, match="needs 3 slots but the layers have 2"):
        AdapterStore(_layers(slots=2), num_slots=3)
    store, adapter = _store_with()
    other = random_adapter(_layers(), seed=2, rank=2)
    other.a.pop("v_proj")
    with pytest.raises(ValueError, match="differ from the model's LoRA layers"):
        store.register("u", other, LRSchedule(1e-3), seed=0)
    wrong = random_adapter(_layers(), seed=2, rank=2)
    wrong.b["v_proj"] = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="shape mismatch at v_proj"):
        store.register("u", wrong, LRSchedule(1e-3), seed=0)
    assert list(store.tenants) == ["t"]
    with pytest.raises(RuntimeError, match="slot 0 has no swapped-in tenant"):
        store.swap_out(0)
    tables = {table: flat.clone() for table, flat in store.tenants["t"].flat.items()}
    with pytest.raises(ValueError, match="master has 3 values, the store 38"):
        store.restore("t", {**tables, "master": torch.zeros(3)}, store.tenants["t"].rng_state, step=1)
    store.swap_in("t", 0)
    with pytest.raises(RuntimeError, match="on the device; swap it out first"):
        store.restore("t", tables, store.tenants["t"].rng_state, step=1)
    with pytest.raises(ValueError, match="on the device; swap it out first"):
        store.remove("t")
    store.swap_out(0)
    store.remove("t")
    assert store.tenants == {}


def test_restore_replaces_the_host_state_and_its_weights() -> None:
    store, adapter = _store_with()
    tables = {table: torch.full_like(flat, float(index)) for index, (table, flat) in enumerate(store.tenants["t"].flat.items())}
    rng = torch.Generator().manual_seed(9).get_state()
    store.restore("t", tables, rng, step=7, kl_coef=0.25)
    state = store.tenants["t"]
    assert (state.step, state.kl_coef) == (7, 0.25) and torch.equal(state.rng_state, rng)
    assert all(torch.equal(state.flat[table], tables[table]) for table in tables)
    assert torch.equal(state.weights.a["q_proj"], torch.zeros(2, 6))  # the masters' cast (table 0 is all zeros)
