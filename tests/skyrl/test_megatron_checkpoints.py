"""Per-tenant checkpoints on SkyRL's Megatron policy worker (``skyrl_clora.skyrl.megatron_checkpoints``), on the CPU.

The store is SkyRL 0.4's own: ``skyrl/backends/skyrl_train/workers/megatron/adapter_store.py`` (``AdapterStore``,
``AdapterSlot``, ``LoraSignature``), loaded from the installed wheel with stand-ins for the three megatron-core
names it imports (``parallel_state``, ``DistributedDataParallel``, ``ChainedOptimizer``), its pinned-memory
allocation made plain CPU memory and ``torch.cuda.current_stream().synchronize()`` a no-op (no CUDA here).
The worker is a stand-in with SkyRL's ``MegatronPolicyWorkerBase`` adapter calls as in
``workers/megatron/megatron_worker.py`` (``prime_optimizer_state``, ``register_pristine_adapter``,
``register_adapter`` -> ``AdapterStore.create``, ``delete_adapter`` -> ``delete``, ``swap_to_adapter`` ->
``swap_to(model_id, actor_module, optimizer)``, ``set_lr``, ``optim_step``), over exactly the attributes the store
touches: model chunks that are DDP instances with ``buffers`` / ``expert_parallel_buffers`` whose buffers have
``param_data`` (bf16), ``grad_data`` (fp32) and ``params`` (views of ``param_data``, named ``...adapter.linear_in
/linear_out.weight``), and an optimizer with ``shard_fp32_from_float16_groups`` (fp32 main params), ``.optimizer``
(torch AdamW over them: ``state`` with ``step``/``exp_avg``/``exp_avg_sq``, ``param_groups``) and
``reload_model_params``. Each ``forward_backward`` draws a dropout mask from torch's RNG, so a tenant's steps
depend on its RNG as well as on its weights and optimizer state.

Tolerance: none. Swapping and checkpointing copy the same bits, and a tenant's steps see the same tensors in the
same order, so restored and continued states are bit-equal.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import skyrl
import torch
from skyrl.train.config import SkyRLTrainConfig

from skyrl_clora.skyrl import megatron_seeding
from skyrl_clora.skyrl.megatron_checkpoints import slot_tensors, with_megatron_tenant_checkpoints

STORE_FILE = Path(skyrl.__file__).parent / "backends/skyrl_train/workers/megatron/adapter_store.py"
D_IN, D_OUT, RANK = 8, 6, 2


class StandInDDP(torch.nn.Module):
    """megatron-core's ``DistributedDataParallel`` as the store sees it (``isinstance`` and the buffers)."""


class StandInChainedOptimizer:
    """megatron-core's ``ChainedOptimizer`` (never instantiated here: one optimizer, as with LoRA on dense models)."""


def _load_store_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    parallel_state = types.SimpleNamespace(get_data_parallel_group=lambda: None)
    fakes = {
        "megatron": types.ModuleType("megatron"), "megatron.core": types.ModuleType("megatron.core"),
        "megatron.core.distributed": types.ModuleType("megatron.core.distributed"),
        "megatron.core.optimizer": types.ModuleType("megatron.core.optimizer"),
    }
    fakes["megatron.core"].parallel_state = parallel_state
    fakes["megatron.core.distributed"].DistributedDataParallel = StandInDDP
    fakes["megatron.core.optimizer"].ChainedOptimizer = StandInChainedOptimizer
    with monkeypatch.context() as patch:
        for name, module in fakes.items():
            patch.setitem(sys.modules, name, module)
        spec = importlib.util.spec_from_file_location("skyrl_adapter_store_under_test", STORE_FILE)
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    module._new_pinned_like = lambda t: torch.empty_like(t, device="cpu")
    return module


@pytest.fixture()
def store_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(megatron_seeding, "parallel_coordinates", lambda: (0, 0, 0))
    return _load_store_module(monkeypatch)


class _Buffer:
    """One DDP buffer: flat bf16 ``param_data`` the params view, flat fp32 ``grad_data``."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        self.params = [p for _, p in chunk.named_parameters()]
        self.param_data = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.bfloat16)
        self.grad_data = torch.zeros(self.param_data.shape, dtype=torch.float32)
        self.grad_views, offset = [], 0
        for param in self.params:
            n = param.numel()
            self.param_data[offset:offset + n].copy_(param.detach().flatten())
            param.data = self.param_data[offset:offset + n].view(param.shape)
            self.grad_views.append(self.grad_data[offset:offset + n].view(param.shape))
            offset += n


class _Chunk(StandInDDP):
    """A model chunk with Megatron-Bridge's LoRA layout on two projections (A: linear_in, B: linear_out = 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)  # the pristine draw (Megatron-Bridge's, at model build)
        for name in ("linear_qkv", "linear_fc1"):
            adapter = torch.nn.Module()
            adapter.linear_in = torch.nn.Linear(D_IN, RANK, bias=False, dtype=torch.bfloat16)
            adapter.linear_out = torch.nn.Linear(RANK, D_OUT, bias=False, dtype=torch.bfloat16)
            torch.nn.init.zeros_(adapter.linear_out.weight)
            projection = torch.nn.Module()
            projection.adapter = adapter
            self.add_module(name, projection)
        self.buffers = [_Buffer(self)]
        self.expert_parallel_buffers = []


class _DistributedOptimizer:
    """Megatron's distributed optimizer on one rank: fp32 main params (one shard per param), AdamW over them."""

    def __init__(self, chunks: list[_Chunk]) -> None:
        self.model_params = [p for chunk in chunks for p in chunk.buffers[0].params]
        self.grads = [g for chunk in chunks for g in chunk.buffers[0].grad_views]
        self.shard_fp32_from_float16_groups = [[p.detach().float().clone() for p in self.model_params]]
        self.optimizer = torch.optim.AdamW(self.shard_fp32_from_float16_groups[0], lr=1e-2, weight_decay=0.01)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def reload_model_params(self) -> None:
        for main, param in zip(self.shard_fp32_from_float16_groups[0], self.model_params):
            main.copy_(param)

    @torch.no_grad()
    def step(self) -> float:
        mains = self.shard_fp32_from_float16_groups[0]
        for main, grad in zip(mains, self.grads):
            main.grad = grad.clone()
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in mains])))
        self.optimizer.step()
        for main, param in zip(mains, self.model_params):
            param.copy_(main)
        return norm


class _MegatronWorker:
    """SkyRL's ``MegatronPolicyWorkerBase`` adapter calls (module docstring) over the stand-in model."""

    def __init__(self, store_module: types.ModuleType) -> None:
        self.cfg = SkyRLTrainConfig().trainer
        self.cfg.policy.model.lora.rank, self.cfg.policy.model.lora.alpha = RANK, 2 * RANK
        self.store_module = store_module
        self.adapter_store = store_module.AdapterStore()
        self.actor_module = [_Chunk()]
        self.optimizer = _DistributedOptimizer(self.actor_module)

    def prime_optimizer_state(self) -> None:
        for main in self.optimizer.shard_fp32_from_float16_groups[0]:
            self.optimizer.optimizer.state[main] = {
                "step": torch.tensor(0.0), "exp_avg": torch.zeros_like(main), "exp_avg_sq": torch.zeros_like(main)}

    def register_pristine_adapter(self) -> None:
        lora = self.cfg.policy.model.lora
        signature = self.store_module.LoraSignature(rank=lora.rank, alpha=lora.alpha, target_modules=("all-linear",),
                                                    lora_type="lora", tp_size=1, pp_size=1, ep_size=1)
        self.adapter_store.register_pristine(self.actor_module, self.optimizer, signature)

    def register_adapter(self, model_id: str) -> None:
        self.adapter_store.create(model_id, self.actor_module, self.optimizer, self.adapter_store.signature)

    def delete_adapter(self, model_id: str) -> None:
        self.adapter_store.delete(model_id)

    def swap_to_adapter(self, model_id: str) -> None:
        self.adapter_store.swap_to(model_id, self.actor_module, self.optimizer)

    def set_lr(self, learning_rate: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Accumulates the live adapter's gradients of a dropout-masked LoRA regression into ``grad_data``."""
        chunk = self.actor_module[0]
        mask = (torch.rand(inputs.shape) > 0.3).float()  # the worker's RNG (dropout)
        leaves = [p.detach().float().requires_grad_() for p in chunk.buffers[0].params]
        loss = torch.zeros(())
        for k in range(0, len(leaves), 2):
            loss = loss + ((inputs * mask) @ leaves[k].T @ leaves[k + 1].T - targets).square().mean()
        for view, grad in zip(chunk.buffers[0].grad_views, torch.autograd.grad(loss, leaves)):
            view.add_(grad)
        return float(loss.detach())

    def optim_step(self) -> float:
        norm = self.optimizer.step()
        self.actor_module[0].buffers[0].grad_data.zero_()
        return norm


SEEDS = {"a": 11, "b": 22, "c": 33}
LRS = {"a": 1e-2, "b": 3e-2, "c": 2e-2}


def _worker(store_module: types.ModuleType, tenants: tuple[str, ...] = ("a", "b")):
    worker = with_megatron_tenant_checkpoints(_MegatronWorker)(store_module)
    worker.prime_optimizer_state()
    worker.register_pristine_adapter()
    worker.set_adapter_seeds(SEEDS)
    for name in tenants:
        worker.register_adapter(name)
    return worker


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, D_IN, generator=generator), torch.randn(4, D_OUT, generator=generator)


def _step(worker, tenant: str, step: int) -> tuple[float, float]:
    """One driver step of ``tenant``: swap in, ``set_lr``, ``forward_backward``, ``optim_step``."""
    worker.swap_to_adapter(tenant)
    worker.set_lr(LRS[tenant] / (1 + step))
    loss = worker.forward_backward(*_batch(step))
    return loss, worker.optim_step()


def _state(worker, tenant: str) -> dict[str, object]:
    """``tenant``'s whole slot (live state snapshotted by a swap away) and scalars, copied."""
    worker.swap_to_adapter("b" if tenant != "b" else "a")
    slot = worker.adapter_store._slots[tenant]
    return {"tensors": {k: v.clone() for k, v in slot_tensors(slot).items()},
            "opt": [[[{k: v for k, v in s.items() if not isinstance(v, torch.Tensor)} for s in g] for g in o]
                    for o in slot.cpu_opt_state],
            "groups": [[{k: v for k, v in s.items() if not isinstance(v, torch.Tensor)} for s in o]
                       for o in slot.cpu_param_group_state],
            "rng": worker._clora_rng[tenant].copy()}


def _assert_equal(left: dict, right: dict) -> None:
    assert left["tensors"].keys() == right["tensors"].keys()
    for key in left["tensors"]:
        assert torch.equal(left["tensors"][key], right["tensors"][key]), key
    assert left["opt"] == right["opt"] and left["groups"] == right["groups"]
    assert left["rng"].keys() == right["rng"].keys()
    assert all(torch.equal(left["rng"][k], right["rng"][k]) for k in left["rng"])


def test_the_checkpoint_holds_what_the_store_keeps_per_adapter(store_module, tmp_path: Path) -> None:
    worker = _worker(store_module)
    for step in range(2):
        _step(worker, "a", step)
        _step(worker, "b", step)
    worker.swap_to_adapter("a")  # a live: saving snapshots it first
    worker.forward_backward(*_batch(9))  # gradients waiting for a's next optim_step travel with its slot
    worker.save_tenant_state("a", str(tmp_path / "a"))
    worker.save_tenant_state("b", str(tmp_path / "b"))  # b parked
    saved_a, saved_b = _state(worker, "a"), _state(worker, "b")
    keys = saved_a["tensors"].keys()
    assert {k.split(".")[0] for k in keys} == {"param_data", "grad_data", "main_param", "opt_state"}
    assert {k.rsplit(".", 1)[1] for k in keys if k.startswith("opt_state")} == {"step", "exp_avg", "exp_avg_sq"}
    assert saved_a["groups"][0][0]["lr"] == LRS["a"] / 2, "the LR the driver set travels with the slot"
    assert torch.count_nonzero(saved_a["tensors"]["grad_data.0.0"]) > 0
    assert not torch.equal(saved_a["tensors"]["main_param.0.0.1"], saved_b["tensors"]["main_param.0.0.1"])

    fresh = _worker(store_module)
    assert fresh.load_tenant_state("a", str(tmp_path / "a")) == 2
    assert fresh.load_tenant_state("b", str(tmp_path / "b")) == 2
    _assert_equal(_state(fresh, "a"), saved_a)
    _assert_equal(_state(fresh, "b"), saved_b)


def _continue(worker, tenant: str, steps: range) -> list[tuple[float, float]]:
    return [_step(worker, tenant, step) for step in steps]


def test_a_restored_tenant_continues_as_if_never_stopped(store_module, tmp_path: Path) -> None:
    reference = _worker(store_module)
    for step in range(2):
        _step(reference, "a", step)
        _step(reference, "b", step)
    reference.save_tenant_state("a", str(tmp_path / "a"))  # a parked: b is live
    expected = _continue(reference, "a", range(2, 5))
    expected_state = _state(reference, "a")

    # A restart: a fresh worker, its own RNG elsewhere, a third tenant registered first and trained.
    torch.manual_seed(999)
    resumed = _worker(store_module, ("c", "a", "b"))
    _continue(resumed, "c", range(3))
    assert resumed.load_tenant_state("a", str(tmp_path / "a")) == 2
    _step(resumed, "b", 0)  # another tenant trains between a's restore and its next step
    assert _continue(resumed, "a", range(2, 5)) == expected
    _assert_equal(_state(resumed, "a"), expected_state)


def test_loading_into_the_live_tenant_replaces_what_it_trained_meanwhile(store_module, tmp_path: Path) -> None:
    worker = _worker(store_module)
    _step(worker, "a", 0)
    worker.save_tenant_state("a", str(tmp_path / "a"))  # a live
    expected = _continue(worker, "a", range(1, 3))
    _step(worker, "b", 0)
    _continue(worker, "a", range(1, 4))  # a trains on past the checkpoint, then is live when it loads
    assert worker.adapter_store.current_id == "a"
    assert worker.load_tenant_state("a", str(tmp_path / "a")) == 1
    assert _continue(worker, "a", range(1, 3)) == expected


def test_each_tenant_has_its_own_rng_and_seeded_start(store_module) -> None:
    worker = _worker(store_module)
    first_a = _step(worker, "a", 0)
    other = _worker(store_module, ("b",))
    _continue(other, "b", range(2))
    other.register_adapter("a")  # a joins after b drew from the RNG: a's RNG starts from its seed all the same
    _continue(other, "b", range(2, 4))  # b's draws do not move a's RNG
    assert _step(other, "a", 0) == first_a
    a_start, b_start = (_worker(store_module, (t,)).actor_module[0].buffers[0].param_data.clone() for t in "ab")
    assert not torch.equal(a_start, b_start), "tenants start from their own seeded LoRA A"


def test_a_checkpoint_of_another_layout_or_none_is_refused(store_module, tmp_path: Path) -> None:
    worker = _worker(store_module)
    with pytest.raises(ValueError, match="holds no Megatron tenant state"):
        worker.load_tenant_state("a", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="'z' is not registered"):
        worker.save_tenant_state("z", str(tmp_path / "z"))
    worker.save_tenant_state("a", str(tmp_path / "a"))
    other = with_megatron_tenant_checkpoints(_MegatronWorker)(store_module)
    other.cfg.policy.model.lora.alpha = 3 * RANK
    other.prime_optimizer_state()
    other.register_pristine_adapter()
    other.register_adapter("a")
    with pytest.raises(ValueError, match="has another signature"):
        other.load_tenant_state("a", str(tmp_path / "a"))
    (tmp_path / "a" / "megatron_tenant_state.rank0.safetensors").rename(tmp_path / "a" / "moved")
    with pytest.raises(ValueError, match="holds no Megatron tenant state for rank 0"):
        worker.load_tenant_state("a", str(tmp_path / "a"))


def test_the_seeding_mixin_comes_with_it() -> None:
    from skyrl_clora.skyrl.megatron_seeding import with_seeded_tenant_adapters

    with pytest.raises(TypeError, match="brings it"):
        with_megatron_tenant_checkpoints(with_seeded_tenant_adapters(_MegatronWorker))
