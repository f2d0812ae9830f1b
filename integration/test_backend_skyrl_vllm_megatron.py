"""``python -m skyrl_clora.main backend=skyrl`` on SkyRL's production stack: vLLM servers + Megatron workers.

Needs a GPU node with >= 2 GPUs (one vLLM server, one Megatron policy worker; not colocated), vllm and
megatron-core (SkyRL's extras) and Ray. Command, from the repository root:

    source scripts/env.sh && SKYRL_CLORA_MODEL=/models/Qwen3-0.6B \
        python -m pytest integration/test_backend_skyrl_vllm_megatron.py -v

The run is the CPU suite's ``test_backend_skyrl_runs_through_main`` with the stand-ins replaced by the
production components (no substitutions): two tenants, GSM8K-format episodes through SkyRL's
``SkyRLGymGenerator`` and ``RemoteInferenceClient`` views against vLLM, ``WorkerDispatch`` per tenant over
SkyRL's Megatron AdapterStore, in-place adapter sync after every step. The step is SkyRL's trainer's: the
behaviour log-probs recomputed by the Megatron workers and SkyRL's KL loss (``use_kl_loss``) against the
frozen base, whose KL is zero while a tenant's adapter is fresh and positive once it has trained.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_node import requires
from skyrl_clora.main import main

pytestmark = requires(gpus=2, modules=("vllm", "megatron", "ray"))


def test_backend_skyrl_with_vllm_and_megatron(model_path: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main([
        "backend=skyrl", "backend.inference_backend=vllm", "backend.strategy=megatron", f"trainer.policy.model.path={model_path}",
        "preset=demo", f"clora.output_dir={out}", "+tenants=2", "trainer.max_training_steps=3", "clora.progress=false",
        "trainer.train_batch_size=2",
        "generator.n_samples_per_prompt=4", "recipe.eval_prompts=8", "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=16",
        "trainer.algorithm.use_kl_loss=true", "trainer.algorithm.kl_loss_coef=0.01",
    ]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["event"] == "failed"], records
    steps = sorted((r["tenant"], r["step"], r["adapter_version"]) for r in records if r["event"] == "step")
    assert steps == [(f"tenant-{t}", s, s) for t in range(2) for s in (1, 2, 3)]
    assert all(r["episodes"] == 8 and r["train/lr"] > 0 and r["train/grad_norm"] > 0
               for r in records if r["event"] == "step")
    kl = {(r["tenant"], r["step"]): r["train/policy_kl"] for r in records if r["event"] == "step"}
    assert all(abs(kl[(f"tenant-{t}", 1)]) < 1e-6 and kl[(f"tenant-{t}", 3)] > 0 for t in range(2)), kl
    assert any(0 < r["reward_mean"] < 1 for r in records if r["event"] == "step"), "rewards never varied"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["inference_backend"], summary["strategy"], summary["substitutions"]) == ("vllm", "megatron", [])
    for tenant in ("tenant-0", "tenant-1"):
        assert (out / "adapters" / tenant / "adapter_model.safetensors").is_file()
