"""The FSDP2 worker's LoRA adapter store (:mod:`skyrl_clora.skyrl.fsdp_store`) on plain modules (no FSDP needed): a
tenant's slot holds each table in one host block with its initial state (LoRA A drawn per seed and parameter name,
B zero, zero moments, the scheduler as built at the tenant's LR); a swap copies the live weights, moments, steps,
gradients and schedule out and the next tenant's in; and the store refuses what it could not keep apart or mirror."""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_clora.skyrl.fsdp_store import FSDPAdapterStore, FSDPLoraSignature, lora_a_initializer


class _Lora(torch.nn.Module):
    def __init__(self, extra_trainable: bool = False) -> None:
        super().__init__()
        self.proj = torch.nn.Module()
        self.proj.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(8, 2, bias=False)})
        self.proj.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 8, bias=False)})
        self.head = torch.nn.Linear(8, 8)
        self.head.requires_grad_(extra_trainable)


def _store(module: torch.nn.Module) -> FSDPAdapterStore:
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    return FSDPAdapterStore(module, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))


def _signature(store: FSDPAdapterStore, rank: int = 2) -> FSDPLoraSignature:
    return FSDPLoraSignature(rank=rank, alpha=4.0, target_modules=("all-linear",), init_method="kaiming", world_size=1,
                             params=tuple((n, tuple(p.shape)) for n, p in zip(store.names, store.params)))


def test_the_store_refuses_a_trainable_parameter_that_is_not_lora() -> None:
    with pytest.raises(RuntimeError, match="trainable non-LoRA parameter 'head.weight'"):
        _store(_Lora(extra_trainable=True))


def test_the_store_refuses_another_signature_and_a_second_registration() -> None:
    store = _store(_Lora())
    store.prime()
    store.register_pristine(_signature(store))
    store.create("a", seed=1, lr=1e-3, signature=_signature(store))
    with pytest.raises(ValueError, match="LoRA signature mismatch for 'b'"):
        store.create("b", seed=2, lr=1e-3, signature=_signature(store, rank=4))
    with pytest.raises(ValueError, match="'a' already registered"):
        store.create("a", seed=1, lr=1e-3, signature=_signature(store))
    with pytest.raises(KeyError, match="unknown adapter 'c'"):
        store.swap_to("c")


def test_a_tenant_slot_holds_each_table_in_one_host_block_with_its_initial_state() -> None:
    store = _store(_Lora())
    store.prime()
    store.register_pristine(_signature(store))
    store.create("a", seed=1, lr=1e-3, signature=_signature(store))
    slot = store.slots["a"]
    tables = (slot.params, slot.grads, slot.exp_avg, slot.exp_avg_sq)
    blocks = {id(table): {t.untyped_storage().data_ptr() for t in table} for table in tables}
    assert all(len(pointers) == 1 for pointers in blocks.values()) and len(set().union(*blocks.values())) == 4
    assert [t.shape for t in slot.params] == [p.shape for p in store.params]
    assert all(not t.any() for t in slot.exp_avg + slot.exp_avg_sq)
    lora_a = [t for name, t in zip(store.names, slot.params) if ".lora_A." in name]
    assert lora_a and all(t.any() for t in lora_a), "lora_A starts drawn, lora_B at zero"


def test_the_store_refuses_optimizer_state_it_does_not_mirror() -> None:
    module = _Lora()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3, amsgrad=True)
    with pytest.raises(RuntimeError, match="amsgrad=True"):
        FSDPAdapterStore(module, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))


def test_an_init_method_without_a_per_tenant_draw_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="init_method=pissa: .* kaiming or gaussian only"):
        lora_a_initializer("pissa", 4)


def _registered(*tenants: tuple[str, int, float]) -> tuple[_Lora, FSDPAdapterStore]:
    """A primed store over a :class:`_Lora` with ``tenants`` (name, seed, lr) created; none is live."""
    module = _Lora()
    store = _store(module)
    store.prime()
    store.register_pristine(_signature(store))
    for name, seed, lr in tenants:
        store.create(name, seed=seed, lr=lr, signature=_signature(store))
    return module, store


def _train_step(module: _Lora, store: FSDPAdapterStore, seed: int) -> None:
    """One AdamW and scheduler step of the live adapter on a random input."""
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
    module.proj.lora_B["default"](module.proj.lora_A["default"](x) + 1.0).sum().backward()
    store.optimizer.step()
    store.scheduler.step()
    store.optimizer.zero_grad()


def test_a_tenants_lora_a_is_drawn_from_its_seed_and_the_parameter_name() -> None:
    _, store = _registered(("a", 1, 1e-3), ("same", 1, 2e-3), ("b", 2, 1e-3))
    a, same, b = (store.slots[name].params for name in ("a", "same", "b"))
    assert store.names == ["proj.lora_A.default.weight", "proj.lora_B.default.weight"]
    assert torch.equal(a[0], same[0]) and not torch.equal(a[0], b[0])
    assert a[0].abs().max() <= 1 / math.sqrt(8), "PEFT's kaiming_uniform(a=sqrt(5)): within 1/sqrt(fan_in)"
    assert not any(t[1].any() for t in (a, same, b))
    assert store.slots["b"].schedule["base_lrs"] == [1e-3] and store.slots["same"].schedule["_last_lr"] == [2e-3]
    gaussian = torch.empty(4, 64)
    lora_a_initializer("gaussian", 4)(gaussian, torch.Generator().manual_seed(0))
    assert torch.equal(gaussian, torch.nn.init.normal_(torch.empty(4, 64), std=0.25,
                                                       generator=torch.Generator().manual_seed(0)))


def test_a_swap_keeps_each_tenants_weights_moments_steps_and_schedule() -> None:
    module, store = _registered(("a", 1, 1e-3), ("b", 2, 5e-3))
    store.swap_to("a")
    assert all(torch.equal(live, slot) for live, slot in zip(store.params, store.slots["a"].params))
    _train_step(module, store, seed=0)
    a_params = [p.detach().clone() for p in store.params]
    a_moments = [store.optimizer.state[p]["exp_avg_sq"].clone() for p in store.params]
    assert a_moments[1].any() and store.tenant_step("a") == 1

    store.swap_to("b")  # b's initial state is live: its weights, zero moments, step 0, its own LR
    assert all(torch.equal(live, slot) for live, slot in zip(store.params, store.slots["b"].params))
    assert not any(store.optimizer.state[p]["exp_avg"].any() or store.optimizer.state[p]["step"] for p in store.params)
    assert store.optimizer.param_groups[0]["lr"] == 5e-3 and store.scheduler.base_lrs == [5e-3]
    assert (store.tenant_step("a"), store.tenant_step("b")) == (1, 0)
    _train_step(module, store, seed=1)
    _train_step(module, store, seed=2)

    store.swap_to("a")  # a continues where it stopped
    assert all(torch.equal(live, want) for live, want in zip(store.params, a_params))
    assert all(torch.equal(store.optimizer.state[p]["exp_avg_sq"], want) for p, want in zip(store.params, a_moments))
    assert all(float(store.optimizer.state[p]["step"]) == 1.0 for p in store.params)
    assert store.optimizer.param_groups[0]["lr"] == 1e-3 and (store.tenant_step("a"), store.tenant_step("b")) == (1, 2)


def test_pending_gradients_travel_with_their_tenant() -> None:
    module, store = _registered(("a", 1, 1e-3), ("b", 2, 1e-3))
    store.swap_to("a")
    module.proj.lora_A["default"](torch.ones(2, 8)).sum().backward()  # a forward_backward without its optim_step
    waiting = store.params[0].grad.clone()
    assert waiting.any() and store.params[1].grad is None
    store.swap_to("b")
    assert all(p.grad is None for p in store.params), "b has no gradients waiting"
    store.swap_to("a")
    assert torch.equal(store.params[0].grad, waiting) and not store.params[1].grad.any()


def test_deleting_the_live_tenant_leaves_none_live() -> None:
    _, store = _registered(("a", 1, 1e-3), ("b", 2, 1e-3))
    store.swap_to("a")
    store.delete("a")
    assert store.current_id is None and list(store.slots) == ["b"]
    store.swap_to("b")  # restores only: nothing to snapshot
    assert store.current_id == "b"
    with pytest.raises(KeyError, match="unknown adapter 'a'"):
        store.delete("a")


def test_the_store_refuses_a_wrong_set_up() -> None:
    module = _Lora()
    with pytest.raises(RuntimeError, match="mirrors torch.optim.AdamW's state; the worker has SGD"):
        FSDPAdapterStore(module, torch.optim.SGD(module.proj.parameters(), lr=1e-3), None)
    adamw = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    with pytest.raises(RuntimeError, match="need a LambdaLR .*; the worker has StepLR"):
        FSDPAdapterStore(module, adamw, torch.optim.lr_scheduler.StepLR(adamw, 1))
    with pytest.raises(RuntimeError, match="no trainable LoRA parameter"):
        FSDPAdapterStore(_Lora().requires_grad_(False), adamw, None)
    store = _store(_Lora())
    with pytest.raises(RuntimeError, match="create called before register_pristine"):
        store.create("a", seed=1, lr=1e-3, signature=_signature(store))
    with pytest.raises(RuntimeError, match="AdamW state missing or unexpected; call prime"):
        store.register_pristine(_signature(store))
    store.prime()
    with pytest.raises(ValueError, match="the signature's parameters are not the live model's"):
        store.register_pristine(FSDPLoraSignature(2, 4.0, ("all-linear",), "kaiming", 1, (("other", (2, 8)),)))
    store.register_pristine(_signature(store))
    with pytest.raises(RuntimeError, match="register_pristine called twice"):
        store.register_pristine(_signature(store))
    with pytest.raises(ValueError, match="'a' learning rate must be > 0, got 0.0"):
        store.create("a", seed=1, lr=0.0, signature=_signature(store))
