"""Tenants on SkyRL 0.4's own FSDP2 policy worker (``skyrl_clora.skyrl.fsdp_tenants``), on the CPU.

The worker runs in a subprocess (``fsdp_scenario.py``: SkyRL's real ``FSDPPolicyWorkerBase`` with patch
0001's form and the tenant mixin, ``fully_shard`` over a gloo group of one rank, SkyRL's bf16 mixed precision,
SkyRL's PPO loss with its default KL loss against the reference policy). Tenant ``a`` trains 3 steps alone on one
worker, and on another worker beside ``b`` (``b``'s ``forward_backward`` between ``a``'s ``forward_backward`` and
``a``'s ``optim_step``, so ``a``'s gradients wait in its slot). Tolerance: none. A swap copies the same bits out
and back, and every op of ``a``'s steps sees the same tensors in the same shapes and order as alone, so on one
machine ``a``'s weights, moments, steps, LR, metrics and gradient norms are bit-equal.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from skyrl.train.config import SkyRLTrainConfig

from tests.support.helpers import differing_keys
from skyrl_clora.backends.skyrl.backend import check_step_report
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.backends.skyrl.stack import check_buildable

from skyrl_clora.trainer.lr_schedule import LRSchedule

SCENARIO = Path(__file__).with_name("fsdp_scenario.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(micro_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp-tenants")
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCENARIO), str(micro_model_dir), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = torch.load(out / "results.pt", weights_only=False)
    loaded["out"] = out
    return loaded


def test_a_tenant_trained_beside_another_ends_bit_equal_to_alone(results: dict) -> None:
    assert differing_keys(results["alone_final"], results["beside_final"]) == []
    assert results["alone_metrics"] == results["beside_metrics"]
    assert results["alone_grad_norms"] == results["beside_grad_norms"]
    assert torch.equal(results["alone_logprobs"], results["beside_logprobs_a"])
    assert differing_keys(results["alone_initial"], results["alone_final"]) != []  # it trained


def test_tenants_start_from_their_own_seed_and_their_outputs_differ(results: dict) -> None:
    initial_a, initial_b = results["alone_initial"], results["beside_initial_b"]
    lora_a = [key for key in initial_a if key.startswith("param.") and ".lora_A." in key]
    lora_b = [key for key in initial_a if key.startswith("param.") and ".lora_B." in key]
    assert lora_a and all(not torch.equal(initial_a[key], initial_b[key]) for key in lora_a)
    assert all(not initial_a[key].any() and not initial_b[key].any() for key in lora_b)  # each starts as the base
    assert not torch.equal(results["beside_logprobs_a"], results["beside_logprobs_b"])
    assert not torch.equal(results["beside_logprobs_a"], results["reference_logprobs"])


def test_each_tenant_runs_its_own_lr_schedule_and_the_driver_accepts_the_reports(results: dict) -> None:
    """SkyRL's scheduler (constant_with_warmup, 2 warm-up steps, 3 steps) from each tenant's LR; the worker's
    ``policy_lr`` is the LR of the step it reports, rounded to float32 by SkyRL's metric all-reduce, which the
    driver's ``check_step_report`` accepts against its own schedule."""
    schedule = LRSchedule(1e-2, warmup_steps=2, total_steps=3, kind="constant_with_warmup")
    reported = [m["policy_lr"] for m in results["alone_metrics"]]
    assert reported == [float(torch.tensor(schedule.lr(k), dtype=torch.float32)) for k in range(3)]
    assert reported[1] != schedule.lr(1)  # float32, not the schedule's float64
    for k, (metrics, grad_norm) in enumerate(zip(results["beside_metrics"], results["beside_grad_norms"])):
        step = {**metrics, "grad_norm": grad_norm, "lr": metrics["policy_lr"]}  # SkyRLStack.step_metrics on FSDP2
        check_step_report("a", schedule.lr(k), grad_norm, metrics, step, "fsdp2")
    assert results["store_state"]["steps"] == {"a": 3, "b": 3}
    assert results["store_state"]["registered"] == ["a", "b"]


def test_a_swap_out_and_back_restores_every_live_tensor_bit_for_bit(results: dict) -> None:
    before, after = results["round_trip"]["before"], results["round_trip"]["after"]
    assert any(key.startswith("grad.") for key in before)  # a's pending gradients went through b's turn
    assert differing_keys(before, after) == []


def test_a_checkpoint_round_trips(results: dict) -> None:
    """Save a, step it, load the save (while b is live), step it again on the same batch: the same step twice."""
    assert results["ckpt_loaded_step"] == 3
    assert results["ckpt_first_grad_norm"] == results["ckpt_second_grad_norm"]
    assert differing_keys(results["ckpt_first"], results["ckpt_second"]) == []
    assert differing_keys(results["ckpt_loaded"], results["beside_final"]) == []
    saved = sorted(path.name for path in (results["out"] / "ckpt-a").iterdir())
    assert saved == ["fsdp_tenant_state.json", "fsdp_tenant_state.rank0.safetensors"]


def test_fsdp2_without_a_gpu_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = SimpleNamespace(strategy="fsdp2", inference_backend="embedded", base=SkyRLTrainConfig())
    with pytest.raises(ConfigError, match="^backend.strategy=fsdp2 runs SkyRL's FSDP2 workers on CUDA GPUs and none "
                                          "is visible; use backend.strategy=embedded"):
        check_buildable(plan)
