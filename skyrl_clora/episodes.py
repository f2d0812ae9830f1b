"""What both backends' tenant loops share: the episode batch handed to SkyRL's generator, the outcome reward
of an episode, and the eval / step records written to metrics.jsonl."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from skyrl.train.generators.base import GeneratorInput, TrajectoryID

logger = logging.getLogger("skyrl_clora")


def episode_batch(seed: int, rows: list[dict[str, Any]], samples: int, tag: str,
                  env_args: dict[str, Any] | None = None,
                  sampling_params: dict[str, Any] | None = None) -> tuple[GeneratorInput, list[TrajectoryID], list[str]]:
    """``samples`` episodes of each dataset row (``prompt``, ``env_class`` and the environment's extras), as
    SkyRL's ``GeneratorInput``; returns it with the trajectory ids and the GRPO group id of each episode
    (``s<seed>-<tag>-p<row>``: named after the tenant's seed, not its name, since the sampler derives each
    request's RNG seed from it). ``env_args`` are added to every episode's extras. ``sampling_params`` (the
    inference backend's format) go with every request; None leaves them to the inference client's defaults
    (the embedded client applies the run's)."""
    prompts, env_classes, extras, trajectory_ids, groups = [], [], [], [], []
    for index, row in enumerate(rows):
        instance = f"s{seed}-{tag}-p{index}"
        for repetition in range(samples):
            prompts.append(row["prompt"])
            env_classes.append(row["env_class"])
            extras.append({**{k: v for k, v in row.items() if k not in ("prompt", "env_class")}, **(env_args or {})})
            trajectory_ids.append(TrajectoryID(instance_id=instance, repetition_id=repetition))
            groups.append(instance)
    batch = GeneratorInput(prompts=prompts, env_classes=env_classes, env_extras=extras, sampling_params=sampling_params,
                           trajectory_ids=trajectory_ids, batch_metadata=None)
    return batch, trajectory_ids, groups


def scalar_reward(reward: float | list[float]) -> float:
    """An episode's outcome reward (SkyRL gives per-token reward lists for multi-turn episodes)."""
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def eval_record(tenant: str, step: int, output: dict[str, Any]) -> dict[str, Any]:
    """The metrics record of an evaluation: accuracy = share of episodes with reward >= 1."""
    rewards = [scalar_reward(r) for r in output["rewards"]]
    return {"event": "eval", "tenant": tenant, "step": step,
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards), "episodes": len(rewards)}


def step_record(tenant: str, step: int, version: int, output: dict[str, Any], timings: dict[str, float],
                train_metrics: dict[str, float]) -> dict[str, Any]:
    """The metrics record of an RL step: rewards, tokens, ``timings`` (rollout_s, train_s, sync_s), the
    trainer's metrics as ``train/*`` and SkyRL's rollout metrics (e.g. the env's reward breakdown) as ``rollout/*``."""
    rewards = [scalar_reward(r) for r in output["rewards"]]
    return {
        "event": "step", "tenant": tenant, "step": step, "adapter_version": version,
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "episodes": len(rewards),
        "generated_tokens": sum(sum(mask) for mask in output["loss_masks"]),
        **timings,
        **{f"train/{k}": v for k, v in train_metrics.items()},
        **{f"rollout/{k}": v for k, v in (output.get("rollout_metrics") or {}).items() if isinstance(v, (int, float))},
    }


def log_orphaned_task_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """SkyRL's generator gathers a batch's episodes without cancelling the rest when one raises; the
    other episodes of a failed tenant (already recorded as failed) then end with errors nobody awaits."""
    error = context.get("exception")
    logger.debug("an episode task ended with an unobserved error (its tenant is failed): %r", error)
