"""vLLM in-place LoRA reload of one tenant while another tenant decodes, with no prefix-cache reset.

Needs a GPU node with >= 1 GPU, vllm (SkyRL's vLLM extras) and Ray. Command, from the repository root:

    source scripts/env.sh && SKYRL_CLORA_MODEL=/models/Qwen3-0.6B \
        python -m pytest integration/test_vllm_inplace_lora_reload.py -v

The stack is the plugin's own (:func:`skyrl_clora.backends.skyrl.stack.build_stack`): vLLM servers started by SkyRL's
``build_new_inference_client`` (LoRA on, prefix caching on), the tenants' ``TenantInferenceClient`` views,
and ``EmbeddedPolicyWorker`` Ray actors for training (so that this test needs no Megatron). Asserted, while
tenant-1 has a long greedy request in flight and tenant-0 trains one step and syncs in place
(``WorkerDispatch.save_weights_for_sampler(model_id="tenant-0")``: PEFT folder + ``load_lora_adapter``):

- tenant-1's in-flight completion is token-for-token the completion of an undisturbed run (no pause,
  no recompute with other weights);
- tenant-1's next request with the same prompt is served from vLLM's prefix cache (the prefix-cache hit
  counter of ``/metrics`` rises by at least one block): the sync reset no cache;
- tenant-0 samples differently after its sync, and the views' versions are 1 (tenant-0) and 0 (tenant-1).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

from gpu_node import requires
from skyrl_clora.backends.skyrl.backend import training_input
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.backends.skyrl.config_translation import translate
from skyrl_clora.backends.skyrl.stack import build_stack

pytestmark = requires(gpus=1, modules=("vllm", "ray"))

GREEDY = {"max_tokens": 256, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}


async def _prefix_cache_hits(url: str) -> float:
    """Sum of vLLM's prefix-cache hit counters (tokens) on one server's Prometheus endpoint."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    values = re.findall(r"^vllm:prefix_cache_hits(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, flags=re.M)
    assert values, "vLLM exposes no prefix_cache_hits counter"
    return sum(float(v) for v in values)


def test_one_tenants_inplace_reload_leaves_the_others_alone(model_path: str, tmp_path: Path) -> None:
    cfg = compose_config([
        "backend=skyrl", f"trainer.policy.model.path={model_path}", f"clora.output_dir={tmp_path}", "backend.strategy=embedded",
        "backend.inference_backend=vllm", "generator.inference_engine.enable_prefix_caching=true", "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=16",
        "+tenants=[{lr:5e-2},{lr:1e-3}]", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
    ])
    run, plan = build_run_config(cfg), translate(cfg, model_path=model_path)
    stack = build_stack(run, plan, model_path)
    names = [spec.name for spec in plan.tenants]
    dispatches = {name: WorkerDispatch(plan.tenant_configs[name], policy_actor_group=stack.policy_group,
                                       inference_engine_client=stack.views[name]) for name in names}
    prompt = stack.tokenizer.encode("A long story about a calculator, told slowly: " * 16)  # >= 95 tokens
    url = stack.client.server_urls[0]

    async def generate(tenant: str, session: str) -> list[int]:
        out = await stack.views[tenant].generate(
            {"prompt_token_ids": [prompt], "session_ids": [session], "sampling_params": GREEDY}, model=tenant)
        return out["response_ids"][0]

    def train_and_sync_tenant_0() -> None:
        episodes = {
            "prompt_token_ids": [prompt[:40]] * 4, "response_ids": [prompt[40:60], prompt[60:70], prompt[70:90], prompt[90:95]],
            "loss_masks": [[1] * 20, [1] * 10, [1] * 20, [1] * 5], "rewards": [1.0, 0.0, 1.0, 0.0],
            "rollout_logprobs": [[-1.0] * 20, [-1.0] * 10, [-1.0] * 20, [-1.0] * 5],
        }
        data = training_input(episodes, ["g0", "g0", "g1", "g1"], stack.tokenizer.pad_token_id,
                              plan.base.trainer.algorithm)
        dispatches["tenant-0"].forward_backward("policy", data, model_id="tenant-0")
        dispatches["tenant-0"].optim_step("policy", model_id="tenant-0")
        asyncio.run(dispatches["tenant-0"].save_weights_for_sampler(model_id="tenant-0"))

    async def scenario():
        reference = await generate("tenant-1", "t1-reference")
        t0_before = await generate("tenant-0", "t0-before")
        in_flight = asyncio.create_task(generate("tenant-1", "t1-disturbed"))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(train_and_sync_tenant_0)
        still_running = not in_flight.done()
        disturbed = await in_flight
        hits = await _prefix_cache_hits(url)
        again = await generate("tenant-1", "t1-again")
        hits_again = await _prefix_cache_hits(url)
        t0_after = await generate("tenant-0", "t0-after")
        for client in [stack.client, *stack.views.values()]:
            await client.teardown()
        return reference, disturbed, still_running, again, hits_again - hits, t0_before, t0_after

    try:
        dispatches["tenant-0"].init_weight_sync_state(stack.client)
        for name, dispatch in dispatches.items():
            dispatch.register_adapter("policy", name)
            asyncio.run(dispatch.save_weights_for_sampler(model_id=name))
        reference, disturbed, still_running, again, new_hits, t0_before, t0_after = asyncio.run(scenario())
        assert still_running, "tenant-1's request must still be decoding when tenant-0's sync lands"
        assert disturbed == reference == again
        assert new_hits >= 16, f"tenant-1's prompt must be served from the prefix cache after the sync ({new_hits})"
        assert t0_after != t0_before
        assert stack.views["tenant-0"].weight_version == 1 and stack.views["tenant-1"].weight_version == 0
    finally:
        stack.shutdown()
