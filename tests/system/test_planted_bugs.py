"""The net under the tenants is itself tested: each bug below is planted with ``monkeypatch`` (as a
wrapper with the bug's effect, so that it follows the code as it moves) and the tests that guard against
it must then fail. A bug that stops failing every test here means the isolation net has a hole. Unpatched, the
same checks pass in their own modules (``test_isolation``, ``test_stale_versions``, ``trainer/``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import transport
from tests.system import test_isolation, test_stale_versions
from skyrl_clora import tenant_loop
from skyrl_clora.backends.embedded import backend as embedded_backend
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.trainer import Trainer


def _isolation_fails(train_mode: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError):
        test_isolation.test_a_tenant_ends_the_same_alone_or_beside_others(train_mode, model_dir, tmp_path, monkeypatch)


def _swap_test_fails(model_dir: Path) -> None:
    with pytest.raises(AssertionError):
        transport.check_swap_a_b_a(transport.swap_trainer(model_dir))


def test_packed_tenants_trained_from_the_first_tenants_weights(learning_model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    swap_in = AdapterStore.swap_in

    def swap_in_over_slot_0(self: AdapterStore, name: str, slot_index: int):
        state = swap_in(self, name, slot_index)
        if slot_index > 0 and self.slots[0].active:  # a packed pass: slot 0 holds its first tenant
            with torch.no_grad():
                torch._foreach_copy_(self.param_views(slot_index), self.param_views(0))
                torch._foreach_copy_(self.table_views(slot_index, "master"), self.table_views(0, "master"))
        return state

    monkeypatch.setattr(AdapterStore, "swap_in", swap_in_over_slot_0)
    _isolation_fails("packed", learning_model_dir, tmp_path, monkeypatch)


def test_packed_tenants_handed_the_first_tenants_weights(micro_model_dir: Path, learning_model_dir: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train_packed = Trainer.train_packed

    def first_weights_for_all(self: Trainer, items):
        results = train_packed(self, items)
        return [(results[0][0], metrics) for _, metrics in results]

    monkeypatch.setattr(Trainer, "train_packed", first_weights_for_all)
    with pytest.raises(AssertionError):
        transport.check_scheduler_returns_stored_weights(micro_model_dir, "packed")
    _isolation_fails("packed", learning_model_dir, tmp_path, monkeypatch)


def test_every_tenant_exporting_the_first_exported_adapter(learning_model_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    save = embedded_backend.save_peft_adapter
    first = []

    def save_first(adapter, out_dir, base_model_path):
        first.append(adapter)
        save(first[0], out_dir, base_model_path)

    monkeypatch.setattr(embedded_backend, "save_peft_adapter", save_first)
    _isolation_fails("swap", learning_model_dir, tmp_path, monkeypatch)


def test_swap_in_skipping_the_second_moment(micro_model_dir: Path, learning_model_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    swap_in = AdapterStore.swap_in

    def swap_in_keeping_exp_avg_sq(self: AdapterStore, name: str, slot_index: int):
        left = [t.clone() for t in self.table_views(slot_index, "exp_avg_sq")]
        state = swap_in(self, name, slot_index)
        with torch.no_grad():
            torch._foreach_copy_(self.table_views(slot_index, "exp_avg_sq"), left)
        return state

    monkeypatch.setattr(AdapterStore, "swap_in", swap_in_keeping_exp_avg_sq)
    _swap_test_fails(micro_model_dir)
    _isolation_fails("swap", learning_model_dir, tmp_path, monkeypatch)


def test_swap_out_not_writing_the_moments_back(micro_model_dir: Path, learning_model_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    swap_out = AdapterStore.swap_out

    def swap_out_dropping_moments(self: AdapterStore, slot_index: int):
        owner = self.tenants[self.slots[slot_index].owner]
        kept = {table: owner.flat[table].clone() for table in ("exp_avg", "exp_avg_sq")}
        state = swap_out(self, slot_index)
        self.wait(state.name)
        for table, values in kept.items():
            state.flat[table].copy_(values)
        return state

    monkeypatch.setattr(AdapterStore, "swap_out", swap_out_dropping_moments)
    _swap_test_fails(micro_model_dir)
    with pytest.raises(AssertionError):
        test_isolation.test_a_tenant_ends_the_same_alone_or_beside_others("swap", learning_model_dir, tmp_path,
                                                                           monkeypatch)


def test_sampled_versions_not_checked(micro_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenant_loop, "check_sampled_versions", lambda tenant, rollout, began_at, now: None)
    with pytest.raises(AssertionError):
        test_stale_versions.test_embedded_stale_trajectory_fails_its_tenant(micro_model_dir, tmp_path, monkeypatch)

