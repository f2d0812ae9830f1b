"""What both backends' tenant loops share: the episode batch handed to SkyRL's generator, the outcome reward
of an episode, and the eval / step records written to metrics.jsonl."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from skyrl.train.generators.base import GeneratorInput, TrajectoryID
from skyrl.train.generators.utils import get_metrics_from_generator_output

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


def eval_record(tenant: str, step: int, output: dict[str, Any], groups: list[str], rows: list[dict[str, Any]],
                samples: int) -> dict[str, Any]:
    """The metrics record of an evaluation of ``rows``, ``samples`` episodes each (``groups``: each episode's row id):
    accuracy = share of episodes with reward >= 1, and SkyRL's evaluation metrics as ``skyrl.train.evaluate`` names
    them: ``avg_score``, ``pass_at_<samples>`` and ``mean_positive_reward`` (SkyRL's
    ``get_metrics_from_generator_output``) over all rows (``eval/all/``) and per data source (a row's ``data_source``:
    ``eval/<data_source>/``, ``/`` written ``_``, none ``unknown``, as SkyRL's ``calculate_per_dataset_metrics``, whose
    module needs torchdata, which the plugin does not), and the rollout metrics under ``eval/all/``."""
    rewards = [scalar_reward(r) for r in output["rewards"]]
    sources = [str(row.get("data_source") or "unknown").replace("/", "_") for row in rows for _ in range(samples)]
    metrics: dict[str, float] = {}
    for source, indices in _indices_by(sources).items():
        scored = {key: [value[i] for i in indices] for key, value in output.items() if isinstance(value, list)}
        scored_groups = [groups[i] for i in indices]
        metrics |= _skyrl_eval_metrics(f"eval/{source}", get_metrics_from_generator_output(scored, scored_groups), samples)
    metrics |= _skyrl_eval_metrics("eval/all", get_metrics_from_generator_output(output, groups), samples)
    rollout = output.get("rollout_metrics") or {}
    metrics |= {f"eval/all/{k}": v for k, v in rollout.items() if isinstance(v, (int, float))}
    return {"event": "eval", "tenant": tenant, "step": step,
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards), "episodes": len(rewards), **metrics}


def _indices_by(keys: list[str]) -> dict[str, list[int]]:
    indices: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        indices.setdefault(key, []).append(index)
    return indices


def _skyrl_eval_metrics(prefix: str, metrics: Any, samples: int) -> dict[str, float]:
    return {f"{prefix}/avg_score": metrics["avg_score"], f"{prefix}/pass_at_{samples}": metrics["pass_at_n"],
            f"{prefix}/mean_positive_reward": metrics["mean_positive_reward"]}


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
