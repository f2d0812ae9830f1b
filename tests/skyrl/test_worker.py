"""SkyRL's WorkerDispatch driving tenants through a Ray actor (EmbeddedPolicyWorker) over the embedded trainer,
and backend=skyrl end to end through main()."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import ray
import skyrl_gym
import torch
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch
from skyrl.train.config import AlgorithmConfig
from skyrl_gym.envs.base_text_env import BaseTextEnv
from transformers import AutoModelForCausalLM

from tests.support.micro_task import assert_learning, register_micro_env
from skyrl_clora.backends.skyrl.backend import training_input
from skyrl_clora.config.build import build_run_config, plan_steps
from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter, load_peft_adapter
from skyrl_clora.config.compose import compose_config
from skyrl_clora.main import main
from skyrl_clora.sampler.requests import SamplingParams
from skyrl_clora.backends.skyrl.config_translation import translate
from skyrl_clora.backends.skyrl.stack import build_stack
from skyrl_clora.skyrl.worker import training_batch_to_train_batch
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.trainer import OptimizerConfig, Trainer, TrainerSettings

pytestmark = pytest.mark.usefixtures("without_production_extras")

PROMPT = list(range(5, 25))
LRS = {"tenant-0": 1e-2, "tenant-1": 3e-3}


def _overrides(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "backend=skyrl", f"trainer.policy.model.path={model_dir}", "preset=demo", f"clora.output_dir={out}",
        "clora.progress=false", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2", "recipe.eval_prompts=2",
        "generator.sampling_params.max_generate_length=8", "generator.max_turns=2", "trainer.max_prompt_length=120", "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.alpha=16", *extra,
    ]


def _episodes() -> tuple[dict, list[str]]:
    """A generator-output-shaped GRPO batch: two groups of two episodes with different rewards."""
    output = {
        "prompt_token_ids": [PROMPT, PROMPT, PROMPT[:12], PROMPT[:12]],
        "response_ids": [[30, 31, 32, 2], [40, 41, 2], [50, 51, 52, 53, 2], [60, 2]],
        "loss_masks": [[1, 1, 1, 1], [1, 0, 1], [1, 1, 0, 1, 1], [1, 1]],
        "rewards": [1.0, 0.0, [0.0, 0.0, 0.0, 0.0, 1.0], 0.0],
        "rollout_logprobs": [[-1.0, -2.0, -0.5, -0.1], [-0.3, -0.2, -0.9], [-1.1, -1.2, -1.3, -1.4, -1.5], [-2.0, -0.2]],
    }
    return output, ["g0", "g0", "g1", "g1"]


def test_training_input_round_trips_to_the_trainers_batch() -> None:
    output, groups = _episodes()
    data = training_input(output, groups, pad_token_id=0, algorithm=AlgorithmConfig())
    batch = training_batch_to_train_batch(data)
    assert batch.prompt_ids == output["prompt_token_ids"] and batch.response_ids == output["response_ids"]
    assert batch.loss_masks == output["loss_masks"]
    assert [pytest.approx(row) for row in output["rollout_logprobs"]] == batch.rollout_logprobs  # float32 tensors
    assert batch.rewards == [1.0, 0.0, 1.0, 0.0] and batch.group_ids == groups
    # What SkyRL's own policy workers read: GRPO advantages (winner > 0 > loser per group) on response tokens.
    advantages = data["advantages"].sum(dim=1) / data["response_mask"].sum(dim=1)
    assert advantages[0] > 0 > advantages[1] and advantages[2] > 0 > advantages[3]
    assert data.metadata["response_length"] == data["response_mask"].shape[1] == 5


def _local_step(model_dir: Path, batch, lr: float, seed: int, algorithm: AlgorithmConfig, micro: int) -> dict:
    """The same tenant step on an in-process Trainer: the reference for what the Ray worker computes."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    routing, layers = attach_multi_lora(model, 1, 16, trainable=True)
    store = AdapterStore(layers, num_slots=1)
    trainer = Trainer(model, routing, layers, store, TrainerSettings(algorithm, OptimizerConfig(),
                                                                     micro_batch_size=micro))
    store.register("t", init_adapter(layers, 8, 16.0, torch.Generator().manual_seed(seed)), LRSchedule(lr), seed=seed)
    return trainer.train_step("t", batch)[1]


@pytest.mark.ray
def test_dispatch_registers_steps_syncs_and_deletes_tenants(micro_model_dir: Path, tmp_path: Path) -> None:
    cfg = compose_config(_overrides(micro_model_dir, tmp_path, "+tenants=[{lr:1e-2},{lr:3e-3}]", "trainer.max_training_steps=4"))
    run, plan = plan_steps(build_run_config(cfg), train_rows=8), translate(cfg)
    stack = build_stack(run, plan, str(micro_model_dir))  # starts (and at shutdown stops) a small local Ray
    dispatches = {name: WorkerDispatch(plan.tenant_configs[name], policy_actor_group=stack.policy_group,
                                       inference_engine_client=stack.views[name]) for name in LRS}
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    def sample(tenant: str) -> list[int]:
        return stack.engine.submit(PROMPT, tenant, greedy).result(timeout=60).token_ids

    try:
        dispatches["tenant-0"].init_weight_sync_state(stack.client)
        for name, dispatch in dispatches.items():
            dispatch.register_adapter("policy", name)
            asyncio.run(dispatch.save_weights_for_sampler(model_id=name))
        assert {n: stack.engine.adapter_version(n) for n in LRS} == {n: stack.views[n].weight_version for n in LRS} == {
            "tenant-0": 0, "tenant-1": 0}
        before = {name: sample(name) for name in LRS}  # PEFT init (B = 0): both still sample as the base model

        output, groups = _episodes()
        data = training_input(output, groups, stack.tokenizer.pad_token_id, plan.base.trainer.algorithm)
        dispatch = dispatches["tenant-0"]
        assert dispatch.forward_backward("policy", data, model_id="tenant-0").metrics["staged_sequences"] == 4.0
        grad_norm = dispatch.optim_step("policy", model_id="tenant-0")
        metrics = stack.step_metrics("tenant-0", {}, grad_norm)
        reference = _local_step(micro_model_dir, training_batch_to_train_batch(data), LRS["tenant-0"], seed=0,
                                algorithm=plan.base.trainer.algorithm, micro=plan.base.trainer.micro_train_batch_size_per_gpu)
        assert grad_norm == metrics["grad_norm"] > 0 and metrics["lr"] == LRS["tenant-0"]
        assert metrics["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        assert metrics["policy_loss"] == pytest.approx(reference["policy_loss"], rel=1e-5, abs=1e-7)

        asyncio.run(dispatch.save_weights_for_sampler(model_id="tenant-0"))
        assert stack.engine.adapter_version("tenant-0") == stack.views["tenant-0"].weight_version == 1
        assert stack.engine.adapter_version("tenant-1") == stack.views["tenant-1"].weight_version == 0
        assert sample("tenant-0") != before["tenant-0"] and sample("tenant-1") == before["tenant-1"]

        dispatches["tenant-1"].forward_backward("policy", data, model_id="tenant-1")
        dispatches["tenant-1"].optim_step("policy", model_id="tenant-1")
        assert stack.step_metrics("tenant-1", {}, None)["lr"] == LRS["tenant-1"]
        state = ray.get(stack.policy_group.async_run_ray_method("pass_through", "adapter_store_state"))[0]
        assert state["steps"] == {"tenant-0": 1, "tenant-1": 1} and state["current_id"] == "tenant-1"
        assert state["registered"] == ["tenant-0", "tenant-1"] and state["num_adapters"] == 2

        dispatches["tenant-1"].delete_adapter("policy", "tenant-1")
        state = ray.get(stack.policy_group.async_run_ray_method("pass_through", "adapter_store_state"))[0]
        assert state["registered"] == ["tenant-0"] and state["num_adapters"] == 1
        with pytest.raises(ray.exceptions.RayTaskError, match="not registered"):
            dispatches["tenant-1"].forward_backward("policy", data, model_id="tenant-1")
    finally:
        asyncio.run(_close(stack))
        stack.shutdown()


async def _close(stack) -> None:
    for client in [stack.client, *stack.views.values()]:
        await client.teardown()


class RaisingRewardEnv(BaseTextEnv):
    """An environment whose reward function raises, as a buggy user reward would."""

    def __init__(self, env_config=None, extras=None) -> None:
        super().__init__()

    def step(self, action: str):
        raise RuntimeError("reward function exploded")


@pytest.mark.e2e
@pytest.mark.ray
def test_backend_skyrl_runs_through_main(learning_model_dir: Path, tmp_path: Path) -> None:
    """Two tenants learn the micro task for 2 steps end to end; a third (tenant-1) whose reward raises fails
    alone (exit status 1)."""
    if "raising_reward_skyrl" not in skyrl_gym.registry:
        skyrl_gym.register(id="raising_reward_skyrl", entry_point=RaisingRewardEnv)
    out = tmp_path / "run"
    tenants = f"+tenants=[{{env_class:{register_micro_env()}}},{{env_class:raising_reward_skyrl}},{{env_class:micro_letters}}]"
    assert main(_overrides(learning_model_dir, out, tenants, "trainer.max_training_steps=2")) == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_learning(records)  # rewards vary and every step took a gradient, computed by the Ray worker
    steps = sorted((r["tenant"], r["step"], r["adapter_version"]) for r in records if r["event"] == "step")
    assert steps == [("tenant-0", 1, 1), ("tenant-0", 2, 2), ("tenant-2", 1, 1), ("tenant-2", 2, 2)]
    assert all(r["episodes"] == 4 and r["train/lr"] == 2e-3 and r["train/response_tokens"] > 0
               for r in records if r["event"] == "step")
    # SkyRL's sampling params reach the server: no turn runs past generator.sampling_params.max_generate_length (8, 2 turns).
    assert all(0 < r["rollout/generate/max_assistant_tokens"] <= 2 * 8 for r in records if r["event"] == "step")
    assert sorted((r["tenant"], r["step"]) for r in records if r["event"] == "eval") == [
        ("tenant-0", 0), ("tenant-0", 2), ("tenant-2", 0), ("tenant-2", 2)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "skyrl" and summary["strategy"] == "embedded"
    assert summary["inference_backend"] == "embedded" and len(summary["substitutions"]) == 2
    assert [row["status"] for row in summary["per_tenant"]] == ["ok", "failed", "ok"]
    assert "reward function exploded" in summary["per_tenant"][1]["error"]
    assert not (out / "adapters" / "tenant-1").exists()
    adapters = [load_peft_adapter(out / "adapters" / name) for name in ("tenant-0", "tenant-2")]
    path = next(iter(adapters[0].a))
    assert not torch.equal(adapters[0].a[path], adapters[1].a[path]), "tenants' seeded adapters must differ"
    assert adapters[0].b[path].abs().sum() > 0 and not torch.equal(adapters[0].b[path], adapters[1].b[path])
    assert (out / "reward_curves.png").is_file()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["backend.inference_backend=vllm"], "vllm is not installed; install vllm or set backend.inference_backend=embedded"),
        (["backend.strategy=megatron", "backend.inference_backend=vllm"], "vllm is not installed"),
        (["backend.strategy=megatron", "backend.inference_backend=embedded"],
         "backend.strategy=megatron needs backend.inference_backend=vllm: SkyRL 0.4's Megatron init_weight_sync_state"),
        (["clora.mode=serial"], "set clora.mode=concurrent"),
        (["trainer.placement.policy_num_gpus_per_node=2"], "runs one worker"),
    ],
)
@pytest.mark.e2e
def test_user_errors_exit_2_with_one_line(micro_model_dir: Path, tmp_path: Path, capsys, overrides, reason) -> None:
    assert main(_overrides(micro_model_dir, tmp_path, *overrides)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and reason in err and "\n" not in err
