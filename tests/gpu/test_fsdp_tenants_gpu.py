"""Tenants on SkyRL 0.4's own FSDP2 policy worker on one CUDA GPU (``tests/skyrl/fsdp_scenario.py ... cuda``: SkyRL's
``cpu:gloo,cuda:nccl`` group of one rank, ``fully_shard`` with SkyRL's bf16 mixed precision and bf16 autocast, the
store's host slots in pinned memory). Skipped without CUDA or without SkyRL (carried as wheels on the GPU machine).

Tolerance: none, as on the CPU. A swap copies the same bits out and back; with torch's deterministic algorithms
(the scenario turns them on, and cuBLAS gets a fixed workspace) every kernel of tenant ``a``'s steps sums in the
same order alone and beside ``b``. Without them SDPA's backward may accumulate in another order from run to run,
which is kernel nondeterminism, not a swap error.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.helpers import differing_keys

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("skyrl") is None, reason="needs skyrl (carried as wheels)"),
]
SCENARIO = Path(__file__).parents[1] / "skyrl" / "fsdp_scenario.py"


@pytest.fixture(scope="module")
def results(micro_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp-tenants-gpu")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_PORT": str(port), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run([sys.executable, str(SCENARIO), str(micro_model_dir), str(out), "cuda"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out / "results.pt", weights_only=False)


def test_fsdp2_tenant_beside_another_ends_bit_equal_to_alone_on_the_gpu(results: dict) -> None:
    assert differing_keys(results["alone_final"], results["beside_final"]) == []
    assert results["alone_metrics"] == results["beside_metrics"]
    assert results["alone_grad_norms"] == results["beside_grad_norms"]
    assert differing_keys(results["alone_initial"], results["alone_final"]) != []


def test_fsdp2_tenants_differ_and_the_reference_is_the_base_on_the_gpu(results: dict) -> None:
    assert not torch.equal(results["beside_logprobs_a"], results["beside_logprobs_b"])
    assert not torch.equal(results["beside_logprobs_a"], results["reference_logprobs"])


def test_fsdp2_swap_round_trip_and_checkpoint_are_exact_on_the_gpu(results: dict) -> None:
    before, after = results["round_trip"]["before"], results["round_trip"]["after"]
    assert any(key.startswith("grad.") for key in before) and differing_keys(before, after) == []
    assert results["ckpt_first_grad_norm"] == results["ckpt_second_grad_norm"]
    assert differing_keys(results["ckpt_first"], results["ckpt_second"]) == []


def test_fsdp2_training_peak_is_measured_without_a_trace_in_the_tenants(results: dict) -> None:
    """The "beside" worker ran ``measure_training_peak`` before its tenants existed; tenant a still ends bit-equal
    to the worker that never measured (the test above), and the report names this GPU and a peak reservation
    no lower than the one the worker keeps."""
    report = results["peak_report"]
    assert report["uuid"] == str(torch.cuda.get_device_properties(0).uuid)
    assert report["peak_reserved"] >= report["reserved"] > 0


def test_fsdp2_worker_reports_its_allocators_counters(results: dict) -> None:
    """After its passes the worker has asked the device for memory and its peak covers the pass it measured."""
    stats = results["allocator_stats"]
    assert set(stats) == {"alloc_retries", "device_mallocs", "device_frees", "peak_reserved"}
    assert stats["device_mallocs"] > 0 and stats["alloc_retries"] >= 0
    assert stats["peak_reserved"] >= results["peak_report"]["peak_reserved"]
