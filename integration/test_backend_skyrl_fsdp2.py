"""``python -m skyrl_clora.main backend=skyrl backend.strategy=fsdp2``: tenants trained by SkyRL 0.4's own FSDP2
policy worker with the plugin's LoRA AdapterStore (``skyrl_clora.skyrl.fsdp_tenants``), served by the embedded
engine behind SkyRL's HTTP protocol.

Needs one CUDA GPU, Ray and SkyRL, and ``flash_attn`` importable (SkyRL's FSDP model wrapper imports
``flash_attn.bert_padding``; ``benchmarks/device_stubs`` holds a stand-in). Command, from the repository root:

    PYTHONPATH=$PYTHONPATH:benchmarks/device_stubs python -m pytest integration/test_backend_skyrl_fsdp2.py -v

Four tenants, three steps each, SkyRL's KL loss against the frozen base (the adapter disabled), per-tenant
checkpoints at step 2 (the store's files): each tenant's step records and exported adapter, the only substitution
being the inference server.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_node import requires
from skyrl_clora.main import main

pytestmark = requires(gpus=1, modules=("ray", "skyrl", "flash_attn"))

TENANTS = [f"tenant-{t}" for t in range(4)]


def _args(model_path: str, out: Path) -> list[str]:
    return [
        "backend=skyrl", "backend.inference_backend=embedded", "backend.strategy=fsdp2",
        f"trainer.policy.model.path={model_path}", "preset=demo", f"clora.output_dir={out}", "+tenants=4",
        "clora.progress=false", "trainer.max_training_steps=3", "trainer.ckpt_interval=2", "trainer.train_batch_size=2",
        "generator.n_samples_per_prompt=4", "recipe.eval_prompts=8", "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.alpha=16", "trainer.flash_attn=false", "trainer.remove_microbatch_padding=false",
        "trainer.algorithm.use_kl_loss=true", "trainer.algorithm.kl_loss_coef=0.01", "sampler.gpu_memory_utilization=0.4",
    ]


def test_backend_skyrl_with_skyrl_fsdp2_workers(model_path: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(_args(model_path, out)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["event"] == "failed"], records
    steps = sorted((r["tenant"], r["step"]) for r in records if r["event"] == "step")
    assert steps == [(tenant, s) for tenant in TENANTS for s in (1, 2, 3)]
    assert all(r["train/lr"] > 0 and r["train/grad_norm"] > 0 for r in records if r["event"] == "step" and r["step"] > 1)
    kl = {(r["tenant"], r["step"]): r["train/policy_kl"] for r in records if r["event"] == "step"}
    assert all(abs(kl[(tenant, 1)]) < 1e-6 and kl[(tenant, 3)] > 0 for tenant in TENANTS), kl
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fsdp2" and len(summary["substitutions"]) == 1  # the inference server only
    for tenant in TENANTS:
        assert (out / "adapters" / tenant / "adapter_model.safetensors").is_file()
        assert list((out / "checkpoints" / tenant / "global_step_2").glob("fsdp_tenant_state.rank0.safetensors"))
