"""SkyRL's real Megatron AdapterStore driven through WorkerDispatch with two tenants.

Needs a GPU node with >= 3 GPUs (2 for the Megatron workers, 1 for a vLLM server), megatron-core and vllm
(SkyRL's extras) and Ray. Command, from the repository root:

    source scripts/env.sh && SKYRL_CLORA_MODEL=/models/Qwen3-0.6B \
        python -m pytest integration/test_megatron_adapter_store.py -v

The stack is the plugin's own (:func:`skyrl_clora.backends.skyrl.stack.build_stack`): SkyRL's Megatron policy workers
(2 GPUs, data parallel, patch 0001's run-time form) under SkyRL's ``PPORayActorGroup``, one ``WorkerDispatch``
per tenant, and a vLLM server (Megatron's ``init_weight_sync_state`` imports vLLM and POSTs
``/init_weight_transfer_engine``: the embedded server is refused with Megatron). Asserted: the KL reference
(``REFERENCE_MODEL_ID``, a never-trained adapter: the base) scores as every fresh tenant does and apart from a
trained one; each tenant's step changes only its own adapter (the other's log-probs are bit equal before and
after); a tenant's sync changes only its own greedy completion on vLLM; a deleted tenant is gone from the
AdapterStore; tenants start from their own seeded adapters (SkyRL 0.4's AdapterStore seeds every tenant from
one pristine slot; the stack's worker re-draws each tenant's LoRA A from its seed: ``SeededTenantAdaptersMixin``, in
``with_megatron_tenant_checkpoints``).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
import ray
import torch
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

from gpu_node import requires
from safetensors.torch import load_file

from skyrl_clora.backends.skyrl.backend import training_input
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.backends.skyrl.config_translation import translate
from skyrl_clora.backends.skyrl.stack import build_stack
from skyrl_clora.skyrl.worker import REFERENCE_MODEL_ID

pytestmark = requires(gpus=3, modules=("megatron", "vllm", "ray"))

TENANTS = {"tenant-0": 1e-3, "tenant-1": 2e-5}


def _episodes(vocab: int) -> tuple[dict, list[str]]:
    """Two GRPO groups of two episodes each with different rewards (4 rows: divisible by DP size 2)."""
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=generator).tolist()

    prompts = [ids(24), ids(24), ids(18), ids(18)]
    responses = [ids(12), ids(9), ids(14), ids(6)]
    return {
        "prompt_token_ids": prompts, "response_ids": responses,
        "loss_masks": [[1] * len(r) for r in responses], "rewards": [1.0, 0.0, 1.0, 0.0],
        "rollout_logprobs": [[-1.0] * len(r) for r in responses],
    }, ["g0", "g0", "g1", "g1"]


def _logprobs(dispatch: WorkerDispatch, data, tenant: str) -> list[torch.Tensor]:
    output = dispatch.forward("policy", data, model_id=tenant)
    return [torch.as_tensor(sample["logprobs"]) for sample in output.loss_fn_outputs]


def _stack(model_path: str, tmp_path: Path):
    cfg = compose_config([
        "backend=skyrl", f"trainer.policy.model.path={model_path}", f"clora.output_dir={tmp_path}",
        "backend.strategy=megatron", "backend.inference_backend=vllm", "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=16",
        "+tenants=[{lr:1e-3},{lr:2e-5}]", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
    ])
    run, plan = build_run_config(cfg), translate(cfg, model_path=model_path)
    assert plan.strategy == "megatron" and plan.inference_backend == "vllm"
    stack = build_stack(run, plan, model_path)
    dispatches = {name: WorkerDispatch(plan.tenant_configs[name], policy_actor_group=stack.policy_group,
                                       inference_engine_client=stack.views[name]) for name in TENANTS}
    dispatches["tenant-0"].init_weight_sync_state(stack.client)
    return plan, stack, dispatches


def _greedy(stack, tenant: str, prompt: list[int]) -> tuple[str, list[float]]:
    """vLLM's greedy completion of the token ids ``prompt`` under ``tenant``'s adapter (OpenAI completions): its
    text and its tokens' log-probs."""
    body = json.dumps({"model": tenant, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "logprobs": 1}).encode()
    request = urllib.request.Request(f"{stack.client.proxy_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        choice = json.loads(response.read())["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_two_tenants_through_the_megatron_adapter_store(model_path: str, tmp_path: Path) -> None:
    plan, stack, dispatches = _stack(model_path, tmp_path)
    prompt = stack.tokenizer.encode("What is 12 + 30?")
    try:
        dispatches["tenant-0"].register_adapter("policy", REFERENCE_MODEL_ID)
        for name, dispatch in dispatches.items():
            dispatch.register_adapter("policy", name)
            asyncio.run(dispatch.save_weights_for_sampler(model_id=name))
        state = ray.get(stack.policy_group.async_run_ray_method("pass_through", "adapter_store_state"))[0]
        assert state["enabled"] and set(TENANTS) | {REFERENCE_MODEL_ID} <= set(state["registered"])

        output, groups = _episodes(len(stack.tokenizer))
        data = training_input(output, groups, stack.tokenizer.pad_token_id, plan.base.trainer.algorithm)
        reference = _logprobs(dispatches["tenant-0"], data, REFERENCE_MODEL_ID)
        before = {name: _logprobs(dispatches[name], data, name) for name in TENANTS}
        assert all(torch.equal(a, b) for a, b in zip(before["tenant-0"], reference)), "a fresh adapter is the base"
        samples_before = {name: _greedy(stack, name, prompt) for name in TENANTS}

        dispatch = dispatches["tenant-0"]
        dispatch.set_lr("policy", TENANTS["tenant-0"], model_id="tenant-0")
        data["action_log_probs"] = torch.nn.utils.rnn.pad_sequence(before["tenant-0"], batch_first=True)
        reported = dispatch.forward_backward("policy", data, model_id="tenant-0").metrics
        assert reported["policy_lr"] == TENANTS["tenant-0"]
        grad_norm = dispatch.optim_step("policy", model_id="tenant-0")
        assert grad_norm is not None and grad_norm > 0
        after = {name: _logprobs(dispatches[name], data, name) for name in TENANTS}
        assert any(not torch.equal(a, b) for a, b in zip(before["tenant-0"], after["tenant-0"])), "tenant-0 must move"
        assert all(torch.equal(a, b) for a, b in zip(before["tenant-1"], after["tenant-1"])), "tenant-1 must not"
        assert all(torch.equal(a, b) for a, b in zip(reference, _logprobs(dispatch, data, REFERENCE_MODEL_ID))), \
            "the reference is never trained"

        asyncio.run(dispatch.save_weights_for_sampler(model_id="tenant-0"))
        assert _greedy(stack, "tenant-1", prompt)[0] == samples_before["tenant-1"][0]
        text, logprobs = _greedy(stack, "tenant-0", prompt)
        moved = text != samples_before["tenant-0"][0] or max(
            abs(a - b) for a, b in zip(logprobs, samples_before["tenant-0"][1])) > 1e-3
        assert moved, "tenant-0's sync must reach vLLM"

        dispatches["tenant-1"].delete_adapter("policy", "tenant-1")
        state = ray.get(stack.policy_group.async_run_ray_method("pass_through", "adapter_store_state"))[0]
        assert "tenant-1" not in state["registered"] and "tenant-0" in state["registered"]
        with pytest.raises(ray.exceptions.RayTaskError):
            dispatches["tenant-1"].forward_backward("policy", data, model_id="tenant-1")
    finally:
        stack.shutdown()


def test_megatron_tenants_start_from_their_own_seeded_adapters(model_path: str, tmp_path: Path) -> None:
    """Each tenant's first sync exports its initial adapter: the LoRA A matrices of tenants with different seeds
    must differ (B is zero for both)."""
    _, stack, dispatches = _stack(model_path, tmp_path)
    try:
        for name, dispatch in dispatches.items():
            dispatch.register_adapter("policy", name)
            asyncio.run(dispatch.save_weights_for_sampler(model_id=name))
        exported = {name: load_file(str(Path(stack.sync_path) / name / "adapter_model.safetensors")) for name in TENANTS}
        a_keys = [key for key in exported["tenant-0"] if "lora_A" in key]
        assert a_keys and all(exported["tenant-0"][k].abs().sum() > 0 for k in a_keys)
        assert any(not torch.equal(exported["tenant-0"][k], exported["tenant-1"][k]) for k in a_keys), \
            "tenants with different seeds start from the same adapter"
    finally:
        stack.shutdown()
