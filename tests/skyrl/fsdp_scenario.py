"""SkyRL 0.4's real FSDP2 policy worker with the tenant mixin, in one process: on the CPU (a gloo group of world
size 1, ``fully_shard`` on CPU DTensors with SkyRL's bf16 mixed precision) or on one CUDA GPU (SkyRL's own
``cpu:gloo,cuda:nccl`` group, torch's deterministic algorithms on).

Run as a script (``python fsdp_scenario.py MODEL_DIR OUT_DIR [cpu|cuda]``) by ``test_fsdp_tenants.py`` (cpu) and
``tests/gpu/test_fsdp_tenants_gpu.py`` (cuda): on the CPU it changes torch's CUDA device selection for the whole
process (below), so it never runs inside a test process. It writes ``OUT_DIR/results.pt`` (what the tests assert
on) and leaves the checkpoints it wrote in ``OUT_DIR``.

CPU stand-ins, this process only: ``torch.cuda.current_device`` answers ``"cpu"`` (SkyRL moves every batch to
it), ``torch.cuda.set_device`` / ``synchronize`` do nothing, device meshes asked for ``"cuda"`` are built on
``"cpu"``, the non-persistent buffers (rotary ``inv_freq``) are broadcast from a CPU tensor, the process group is
gloo. SkyRL's ``torch.autocast(device_type="cuda")`` is inert without CUDA, so the compute is FSDP2's bf16
parameter cast. Both devices: ``benchmarks/device_stubs`` (``flash_attn.bert_padding``) is appended to
``sys.path``, SkyRL runs with ``flash_attn=false``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = "clora:reference"


def _cpu_device_selection() -> None:
    import torch.distributed.device_mesh as device_mesh

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    build_mesh = device_mesh.init_device_mesh

    def cpu_mesh(device_type: str, *args, **kwargs):
        return build_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = cpu_mesh
    from skyrl.backends.skyrl_train.distributed import fsdp_utils

    fsdp_utils.init_device_mesh = cpu_mesh

    def sync_buffers_on_cpu(model: torch.nn.Module, loaded_sd: dict) -> None:
        """SkyRL's ``_sync_non_persistent_buffers`` with the broadcast through a CPU tensor (gloo)."""
        for module in model.modules():
            for key in sorted(getattr(module, "_non_persistent_buffers_set", set())):
                buf = module._buffers.get(key)
                if buf is not None:
                    src = buf.detach().clone()
                    torch.distributed.broadcast(src, src=0)
                    module._buffers[key] = src

    fsdp_utils._sync_non_persistent_buffers = sync_buffers_on_cpu


def _config(model_dir: str, sync_dir: str):
    from skyrl.train.config import SkyRLTrainConfig

    cfg = SkyRLTrainConfig()
    tr = cfg.trainer
    tr.strategy, tr.flash_attn, tr.remove_microbatch_padding, tr.gradient_checkpointing = "fsdp", False, False, False
    tr.micro_train_batch_size_per_gpu = tr.micro_forward_batch_size_per_gpu = 2
    tr.policy.model.path = model_dir
    tr.policy.model.lora.rank, tr.policy.model.lora.alpha = 4, 8
    tr.policy.model.lora.lora_sync_path = sync_dir
    optimizer = tr.policy.optimizer_config
    optimizer.lr, optimizer.weight_decay, optimizer.max_grad_norm = 1e-2, 0.01, 1.0
    optimizer.scheduler, optimizer.num_warmup_steps = "constant_with_warmup", 2
    tr.algorithm.temperature = 1.0
    return tr


def _batch(seed: int, pad_token_id: int):
    """A GRPO-shaped ``TrainingInputBatch`` of 4 rows (2 groups), as the skyrl driver builds it."""
    from skyrl.train.config import AlgorithmConfig

    from skyrl_clora.backends.skyrl.backend import training_input

    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (9, 9, 6, 6)]
    responses = [torch.randint(5, 300, (n,), generator=generator).tolist() + [2] for n in (4, 2, 5, 3)]
    output = {"prompt_token_ids": prompts, "response_ids": responses, "loss_masks": [[1] * len(r) for r in responses],
              "rewards": [1.0, 0.0, 0.0, 1.0], "rollout_logprobs": [[-1.0] * len(r) for r in responses]}
    return training_input(output, ["g0", "g0", "g1", "g1"], pad_token_id, AlgorithmConfig())


class Harness:
    """One worker (SkyRL's ``FSDPPolicyWorkerBase`` + patch 0001's form + the tenant mixin) and its tenants."""

    def __init__(self, model_dir: str, sync_dir: str, tenants: dict[str, dict[str, float]], steps: int,
                 measure_peak: bool = False) -> None:
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

        from skyrl_clora.skyrl.fsdp_tenants import with_fsdp_tenants
        from skyrl_clora.skyrl.worker_patches import with_per_tenant_lora_sync

        worker_cls = with_fsdp_tenants(with_per_tenant_lora_sync(FSDPPolicyWorkerBase))
        self.worker = worker_cls(cfg=_config(model_dir, sync_dir), world_size=1, rank=0, local_rank=0,
                                 master_addr="127.0.0.1", master_port=0, sequence_parallel_size=1)
        self.worker.init_worker_process_group()
        self.worker.init_model(model_dir, num_training_steps=steps)
        self.worker._set_pad_token_id(0)
        self.worker.prime_optimizer_state()
        self.worker.register_pristine_adapter()
        self.peak_report = None
        if measure_peak:  # a throwaway tenant's pass before the tenants exist: it must leave no trace in them
            from skyrl_clora.backends.skyrl.shared_gpu import peak_pass_batch

            self.peak_report = self.worker.measure_training_peak(peak_pass_batch(2, 24, 300, 0, with_reference=True))
        self.worker.set_tenant_specs(tenants)
        self.worker.register_adapter(REFERENCE)  # SkyRL's use_kl_loss (its default): the base as the reference
        for name in tenants:
            self.worker.register_adapter(name)

    def logprobs(self, tenant: str, data) -> torch.Tensor:
        from skyrl.backends.skyrl_train.distributed.dispatch import loss_fn_outputs_to_tensor

        self.worker.swap_to_adapter(tenant)
        scoring = data.select(keys=["sequences", "attention_mask"], metadata_keys=["response_length"])
        return loss_fn_outputs_to_tensor(self.worker.forward(scoring).loss_fn_outputs)

    def forward_backward(self, tenant: str, data) -> dict[str, float]:
        data["action_log_probs"] = self.logprobs(tenant, data)
        data["base_action_log_probs"] = self.logprobs(REFERENCE, data)
        self.worker.swap_to_adapter(tenant)
        return dict(self.worker.forward_backward(data).metrics)

    def optim_step(self, tenant: str) -> float:
        self.worker.swap_to_adapter(tenant)
        return float(self.worker.optim_step())

    def state(self, tenant: str) -> dict[str, torch.Tensor]:
        """The tenant's LoRA weights, moments and steps as the store holds them (live state snapshotted first)."""
        store = self.worker._clora_store
        slot = store.slots[tenant]
        if store.current_id == tenant:
            store.snapshot(slot)
        out = {f"param.{n}": t.clone() for n, t in zip(store.names, slot.params)}
        out |= {f"exp_avg.{n}": t.clone() for n, t in zip(store.names, slot.exp_avg)}
        out |= {f"exp_avg_sq.{n}": t.clone() for n, t in zip(store.names, slot.exp_avg_sq)}
        out["steps"] = slot.steps.clone()
        out["lr"] = torch.tensor(slot.schedule["_last_lr"], dtype=torch.float64)
        return out

    def live(self) -> dict[str, torch.Tensor]:
        """Every live tensor the store swaps (local shards), cloned, and the live scheduler LR and CPU RNG."""
        from skyrl_clora.skyrl.fsdp_store import local

        store = self.worker._clora_store
        out = {}
        for name, param in zip(store.names, store.params):
            state = store.optimizer.state[param]
            out[f"param.{name}"] = local(param).detach().clone()
            out[f"exp_avg.{name}"] = local(state["exp_avg"]).clone()
            out[f"exp_avg_sq.{name}"] = local(state["exp_avg_sq"]).clone()
            out[f"step.{name}"] = state["step"].clone()
            if param.grad is not None:
                out[f"grad.{name}"] = local(param.grad).clone()
        out["lr"] = torch.tensor([group["lr"] for group in store.optimizer.param_groups], dtype=torch.float64)
        out["rng"] = torch.get_rng_state()
        return out


def main(model_dir: str, out_dir: str, device: str) -> None:
    sys.path.append(str(ROOT / "benchmarks" / "device_stubs"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    torch.set_num_threads(1)
    if device == "cpu":
        _cpu_device_selection()
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    else:  # bit-equal runs need SDPA's and cuBLAS's deterministic kernels (the workspace is set by the caller)
        torch.use_deterministic_algorithms(True, warn_only=True)
    out = Path(out_dir)
    tenants = {"a": {"seed": 1, "lr": 1e-2}, "b": {"seed": 2, "lr": 3e-2}}
    batches = [_batch(100 + k, 0) for k in range(3)]
    other = [_batch(200 + k, 0) for k in range(3)]
    results: dict[str, object] = {}

    alone = Harness(model_dir, str(out / "sync-alone"), {"a": tenants["a"]}, steps=3)
    results["alone_initial"] = alone.state("a")
    results["alone_metrics"], results["alone_grad_norms"] = [], []
    for k in range(3):
        results["alone_metrics"].append(alone.forward_backward("a", batches[k]))
        results["alone_grad_norms"].append(alone.optim_step("a"))
    results["alone_final"] = alone.state("a")
    results["alone_logprobs"] = alone.logprobs("a", batches[0])
    del alone

    beside = Harness(model_dir, str(out / "sync-beside"), tenants, steps=3, measure_peak=device == "cuda")
    results["peak_report"] = beside.peak_report
    results["beside_initial_b"] = beside.state("b")
    results["beside_metrics"], results["beside_grad_norms"] = [], []
    for k in range(3):  # b's forward_backward lands between a's forward_backward and a's optim_step
        metrics = beside.forward_backward("a", batches[k])
        beside.forward_backward("b", other[k])
        round_trip = {}
        if k == 1:  # a's pending gradients swap out and back bit for bit
            beside.worker.swap_to_adapter("a")
            round_trip["before"] = beside.live()
            beside.worker.swap_to_adapter("b")
            beside.worker.swap_to_adapter("a")
            round_trip["after"] = beside.live()
            results["round_trip"] = round_trip
        results["beside_grad_norms"].append(beside.optim_step("a"))
        beside.optim_step("b")
        results["beside_metrics"].append(metrics)
    results["beside_final"] = beside.state("a")
    results["beside_logprobs_a"] = beside.logprobs("a", batches[0])
    results["beside_logprobs_b"] = beside.logprobs("b", batches[0])
    results["reference_logprobs"] = beside.logprobs(REFERENCE, batches[0])
    results["store_state"] = beside.worker.adapter_store_state()

    # checkpoint: save a, step it once more, load the save and step again: the same step twice
    beside.worker.save_tenant_state("a", str(out / "ckpt-a"))
    beside.worker.save_tenant_state("b", str(out / "ckpt-b"))
    step_batch = _batch(300, 0)
    beside.forward_backward("a", step_batch)
    results["ckpt_first_grad_norm"] = beside.optim_step("a")
    results["ckpt_first"] = beside.state("a")
    beside.worker.swap_to_adapter("b")
    results["ckpt_loaded_step"] = beside.worker.load_tenant_state("a", str(out / "ckpt-a"))
    results["ckpt_loaded"] = beside.state("a")
    beside.forward_backward("a", _batch(300, 0))
    results["ckpt_second_grad_norm"] = beside.optim_step("a")
    results["ckpt_second"] = beside.state("a")
    if device == "cuda":
        results["allocator_stats"] = beside.worker.allocator_stats()
    torch.save(results, out / "results.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "cpu")
