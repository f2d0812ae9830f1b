"""A tenant's training state on disk (:mod:`skyrl_clora.trainer.state_io`): written and read back into a tenant of
the same shape it is the same state bit for bit (tables, RNG, step, KL controller value) with its weights the
masters' cast; a tenant on the device is not written, and a checkpoint of another rank, alpha or layer
signature is refused naming what differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from skyrl_clora.trainer.adapter_store import TABLES, AdapterStore
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.state_io import META, TENSORS, read_tenant_state, write_tenant_state
from tests.support.helpers import random_adapter
from tests.support.tiny_lora_layers import two_projection_layers


def _store(rank: int = 2, alpha: float = 4.0, v_out: int = 5, seed: int = 0) -> AdapterStore:
    """A one-slot store with tenant ``t`` registered (a random adapter drawn from ``seed``)."""
    layers = two_projection_layers(slots=1, max_rank=4, v_out=v_out)
    store = AdapterStore(layers, num_slots=1)
    store.register("t", random_adapter(layers, seed=seed, rank=rank, alpha=alpha), LRSchedule(1e-3), seed=seed)
    return store


def _trained(store: AdapterStore) -> None:
    """Gives tenant ``t`` a state unlike a fresh one: every table, RNG, step and KL value changed."""
    state = store.tenants["t"]
    for index, table in enumerate(TABLES):
        state.flat[table].copy_(torch.linspace(-1.0, 1.0, state.flat[table].numel()) * (index + 1))
    state.rng_state = torch.Generator().manual_seed(42).get_state()
    state.step, state.kl_coef = 3, 0.1 + 0.2  # a float JSON must keep exactly


def test_a_written_state_reads_back_bit_for_bit(tmp_path: Path) -> None:
    written = _store()
    _trained(written)
    write_tenant_state(written, "t", tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([META, TENSORS])
    assert json.loads((tmp_path / META).read_text())["signature"] == {"q_proj": [6, 4], "v_proj": [4, 5]}
    read = _store(seed=1)
    read_tenant_state(read, "t", tmp_path)
    got, want = read.tenants["t"], written.tenants["t"]
    assert all(torch.equal(got.flat[table], want.flat[table]) for table in TABLES)
    assert torch.equal(got.rng_state, want.rng_state) and (got.step, got.kl_coef) == (3, 0.1 + 0.2)
    assert torch.equal(got.weights.b["v_proj"], want.master["v_proj.b"])


def test_a_tenant_on_the_device_is_not_written(tmp_path: Path) -> None:
    store = _store()
    store.swap_in("t", 0)
    with pytest.raises(RuntimeError, match="'t' is on the device"):
        write_tenant_state(store, "t", tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("other, differing", [(dict(rank=3), "rank"), (dict(alpha=8.0), "alpha"),
                                              (dict(v_out=7), "signature"), (dict(rank=3, alpha=2.0), "rank, alpha")])
def test_a_checkpoint_of_another_shape_is_refused(tmp_path: Path, other: dict, differing: str) -> None:
    write_tenant_state(_store(), "t", tmp_path)
    store = _store(**other)
    before = store.tenants["t"].flat["master"].clone()
    with pytest.raises(ValueError, match=f"tenant 't': the checkpoint in .* has another {differing}$"):
        read_tenant_state(store, "t", tmp_path)
    assert torch.equal(store.tenants["t"].flat["master"], before)
