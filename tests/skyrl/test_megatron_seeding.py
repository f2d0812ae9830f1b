"""Per-tenant initial adapters on Megatron (``with_seeded_tenant_adapters``), over a stand-in of the worker calls
it makes: SkyRL 0.4's ``register_adapter`` seeds every adapter from one pristine slot, and ``swap_to_adapter``
snapshots the live LoRA into the current adapter's slot and restores the next one (``AdapterStore.swap_to``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from skyrl.train.config import SkyRLTrainConfig

from skyrl_clora.skyrl import megatron_seeding
from skyrl_clora.skyrl.megatron_seeding import with_seeded_tenant_adapters


class _Chunk(torch.nn.Module):
    """One model chunk with Megatron-Bridge's LoRA layout on two projections (A: linear_in, B: linear_out = 0)."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("linear_qkv", "linear_fc1"):
            adapter = torch.nn.Module()
            adapter.linear_in = torch.nn.Linear(16, 4, bias=False)
            adapter.linear_out = torch.nn.Linear(4, 24, bias=False)
            torch.nn.init.zeros_(adapter.linear_out.weight)
            projection = torch.nn.Module()
            projection.adapter = adapter
            self.add_module(name, projection)


class _StockWorker:
    """SkyRL's registration semantics: a new adapter gets a copy of the pristine slot; one adapter is live."""

    def __init__(self, init_method: str = "kaiming") -> None:
        torch.manual_seed(1234)  # the pristine draw (Megatron-Bridge's, at model build)
        self.cfg = SkyRLTrainConfig().trainer
        self.cfg.policy.model.lora.init_method = init_method
        self.actor_module = [_Chunk()]
        self.pristine = self._state()
        self.slots: dict[str, dict[str, torch.Tensor]] = {}
        self.current: str | None = None
        self.reloads = 0
        self.optimizer = SimpleNamespace(reload_model_params=self._reload)

    def _reload(self) -> None:
        self.reloads += 1

    def _state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.actor_module[0].named_parameters()}

    def register_adapter(self, model_id: str) -> None:
        if self.current is None:
            self.current = model_id  # the first adapter is the live (pristine) state
        self.slots[model_id] = {name: t.clone() for name, t in self.pristine.items()}

    def swap_to_adapter(self, model_id: str) -> None:
        if model_id == self.current:
            return
        self.slots[self.current] = self._state()
        with torch.no_grad():
            for name, param in self.actor_module[0].named_parameters():
                param.copy_(self.slots[model_id][name])
        self.current = model_id

    def adapter(self, model_id: str) -> dict[str, torch.Tensor]:
        self.swap_to_adapter(model_id)
        return self._state()


def _registered(seeds: dict[str, int], ids: list[str], init_method: str = "kaiming"):
    worker = with_seeded_tenant_adapters(_StockWorker)(init_method)
    worker.set_adapter_seeds(seeds)
    for model_id in ids:
        worker.register_adapter(model_id)
    return worker


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron_seeding, "parallel_coordinates", lambda: (0, 0, 0))


@pytest.mark.parametrize("init_method", ["kaiming", "xavier"])
def test_tenants_start_from_their_own_seeds_and_the_reference_stays_pristine(init_method: str) -> None:
    worker = _registered({"tenant-0": 0, "tenant-1": 1}, ["tenant-0", "tenant-1", "clora:reference"], init_method)
    adapters = {name: worker.adapter(name) for name in ("tenant-0", "tenant-1", "clora:reference")}
    a_names = [n for n in adapters["tenant-0"] if n.endswith("linear_in.weight")]
    b_names = [n for n in adapters["tenant-0"] if n.endswith("linear_out.weight")]
    assert len(a_names) == 2 and len(b_names) == 2
    for name in a_names:
        assert not torch.equal(adapters["tenant-0"][name], adapters["tenant-1"][name]), "same start for two seeds"
        assert not torch.equal(adapters["tenant-0"][name], worker.pristine[name])
        assert torch.equal(adapters["clora:reference"][name], worker.pristine[name])
        # Megatron-Bridge's draw: U(-b, b), b = 1/sqrt(fan_in) (kaiming, a=sqrt(5)) or sqrt(6/(fan_in+fan_out)).
        fan_out, fan_in = adapters["tenant-0"][name].shape
        bound = (6 / (fan_in + fan_out)) ** 0.5 if init_method == "xavier" else fan_in ** -0.5
        assert 0.5 * bound < adapters["tenant-0"][name].abs().max() <= bound
    assert all(torch.count_nonzero(adapters[t][n]) == 0 for t in adapters for n in b_names), "B stays zero"
    assert worker.reloads == 2, "the optimizer's fp32 main params follow each re-drawn adapter"
    # The same seed gives the same adapter (another worker, another registration order).
    again = _registered({"tenant-1": 1}, ["tenant-1"], init_method).adapter("tenant-1")
    assert all(torch.equal(again[n], adapters["tenant-1"][n]) for n in a_names)


def test_tensor_parallel_shards_draw_their_own_values(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _registered({"t": 3}, ["t"]).adapter("t")
    monkeypatch.setattr(megatron_seeding, "parallel_coordinates", lambda: (1, 0, 0))
    second = _registered({"t": 3}, ["t"]).adapter("t")
    names = [n for n in first if n.endswith("linear_in.weight")]
    assert all(not torch.equal(first[n], second[n]) for n in names)


def test_a_registration_that_left_b_non_zero_is_refused() -> None:
    worker = with_seeded_tenant_adapters(_StockWorker)()
    with torch.no_grad():
        next(p for n, p in worker.actor_module[0].named_parameters() if n.endswith("linear_out.weight")).fill_(1.0)
    worker.pristine = worker._state()
    worker.set_adapter_seeds({"t": 0})
    with pytest.raises(RuntimeError, match="is not zero after registration"):
        worker.register_adapter("t")


def test_unknown_init_methods_and_worker_classes_are_refused() -> None:
    with pytest.raises(ValueError, match="xavier and kaiming only"):
        _registered({"t": 0}, ["t"], init_method="normal")
    with pytest.raises(TypeError, match="has no register_adapter"):
        with_seeded_tenant_adapters(object)
