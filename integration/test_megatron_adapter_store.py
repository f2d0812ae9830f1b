"""SkyRL's real Megatron AdapterStore driven through WorkerDispatch with two tenants.

Needs a GPU node with >= 2 GPUs, megatron-core (SkyRL's Megatron extras) and Ray. Command, from the
repository root:

    source scripts/env.sh && SKYRL_CLORA_MODEL=/models/Qwen3-0.6B \
        python -m pytest integration/test_megatron_adapter_store.py -v

The stack is the plugin's own (:func:`skyrl_clora.skyrl.stack.build_stack`): SkyRL's Megatron policy workers
(2 GPUs, data parallel, patch 0001's run-time form) under SkyRL's ``PPORayActorGroup``, one ``WorkerDispatch``
per tenant, and the embedded engine behind SkyRL's HTTP protocol as the inference server (so that this test
needs no vLLM). Asserted: each tenant's step changes only its own adapter (the other's log-probs are bit
equal before and after), per-tenant learning rates reach the optimizer, a tenant's sync loads only its
adapter into the server (version fence), and a deleted tenant is gone from the AdapterStore.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import ray
import torch
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

from gpu_node import requires
from skyrl_clora.config_build import build_run_config
from skyrl_clora.main import compose_config
from skyrl_clora.sampler.requests import SamplingParams
from skyrl_clora.skyrl.config_translation import translate
from skyrl_clora.skyrl.driver import training_input
from skyrl_clora.skyrl.stack import build_stack

pytestmark = requires(gpus=2, modules=("megatron", "ray"))

TENANTS = {"tenant-0": 1e-4, "tenant-1": 2e-5}


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


def test_two_tenants_through_the_megatron_adapter_store(model_path: str, tmp_path: Path) -> None:
    cfg = compose_config([
        "backend=skyrl", f"trainer.policy.model.path={model_path}", f"clora.output_dir={tmp_path}", "backend.strategy=megatron",
        "backend.inference_backend=embedded", "trainer.placement.policy_num_gpus_per_node=2", "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=16",
        "+tenants=[{lr:1e-4},{lr:2e-5}]", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
    ])
    run, plan = build_run_config(cfg), translate(cfg, model_path=model_path)
    assert plan.strategy == "megatron" and plan.inference_backend == "embedded"
    stack = build_stack(run, plan, model_path)
    dispatches = {name: WorkerDispatch(plan.tenant_configs[name], policy_actor_group=stack.policy_group,
                                       inference_engine_client=stack.views[name]) for name in TENANTS}
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = stack.tokenizer.encode("What is 12 + 30?")

    def sample(tenant: str) -> list[int]:
        return stack.engine.submit(prompt, tenant, greedy).result(timeout=300).token_ids

    try:
        dispatches["tenant-0"].init_weight_sync_state(stack.client)
        for name, dispatch in dispatches.items():
            dispatch.register_adapter("policy", name)
            asyncio.run(dispatch.save_weights_for_sampler(model_id=name))
        state = ray.get(stack.policy_group.async_run_ray_method("pass_through", "adapter_store_state"))[0]
        assert state["enabled"] and set(TENANTS) <= set(state["registered"])
        assert {n: stack.engine.adapter_version(n) for n in TENANTS} == {n: 0 for n in TENANTS}

        output, groups = _episodes(len(stack.tokenizer))
        data = training_input(output, groups, stack.tokenizer.pad_token_id, plan.base.trainer.algorithm)
        before = {name: _logprobs(dispatches[name], data, name) for name in TENANTS}
        samples_before = {name: sample(name) for name in TENANTS}

        dispatch = dispatches["tenant-0"]
        dispatch.set_lr("policy", TENANTS["tenant-0"], model_id="tenant-0")
        dispatch.forward_backward("policy", data, model_id="tenant-0")
        grad_norm = dispatch.optim_step("policy", model_id="tenant-0")
        assert grad_norm is not None and grad_norm > 0
        after = {name: _logprobs(dispatches[name], data, name) for name in TENANTS}
        assert any(not torch.equal(a, b) for a, b in zip(before["tenant-0"], after["tenant-0"])), "tenant-0 must move"
        assert all(torch.equal(a, b) for a, b in zip(before["tenant-1"], after["tenant-1"])), "tenant-1 must not"

        asyncio.run(dispatch.save_weights_for_sampler(model_id="tenant-0"))
        assert stack.engine.adapter_version("tenant-0") == stack.views["tenant-0"].weight_version == 1
        assert stack.engine.adapter_version("tenant-1") == stack.views["tenant-1"].weight_version == 0
        assert sample("tenant-1") == samples_before["tenant-1"]

        dispatches["tenant-1"].delete_adapter("policy", "tenant-1")
        state = ray.get(stack.policy_group.async_run_ray_method("pass_through", "adapter_store_state"))[0]
        assert "tenant-1" not in state["registered"] and "tenant-0" in state["registered"]
        with pytest.raises(ray.exceptions.RayTaskError):
            dispatches["tenant-1"].forward_backward("policy", data, model_id="tenant-1")
    finally:
        stack.shutdown()
