"""tau-bench's reward: the goal database reached and every expected output said.

For a finished episode (the user stopped or the agent transferred to a human):

1. Replay the task's ground-truth actions, except the terminating ``transfer_to_human_agents``, on a
   fresh database. ``r_actions`` is 1.0 iff the episode's database equals that goal database (the
   benchmark compares hashes of the two; :func:`..db.diff_databases` compares the same canonical form).
2. If the task has expected outputs, ``r_outputs`` is 1.0 iff every output, lowercased, is a substring of
   some reply of the agent to the user lowercased with its commas removed (the output itself keeps its
   commas, as in the benchmark). A task without outputs has ``r_outputs`` 1.0.
3. ``reward`` is 1.0 iff both checks pass, else 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from skyrl_clora.recipes.taubench.data import RetailData, Task
from skyrl_clora.recipes.taubench.db import Database, Record, diff_databases
from skyrl_clora.recipes.taubench.tools import TERMINATE_TOOLS, invoke


@dataclass
class RewardInfo:
    """The reward of one episode and why: ``failed_checks`` names the checks that failed ("actions",
    "outputs"), ``outputs`` says for each expected output whether it was found, and
    ``differing_records`` lists the ``table/id`` records where the episode's database differs from the
    goal database."""

    reward: float
    r_actions: float
    r_outputs: float
    outputs: dict[str, bool] = field(default_factory=dict)
    differing_records: list[str] = field(default_factory=list)

    @property
    def failed_checks(self) -> list[str]:
        failed = []
        if self.r_actions < 1.0:
            failed.append("actions")
        if self.r_outputs < 1.0:
            failed.append("outputs")
        return failed


def goal_database(data: RetailData, task: Task) -> Database:
    """A fresh database after replaying the task's ground-truth actions (terminating tools skipped)."""
    db = data.fresh_db()
    for action in task.actions:
        if action.name not in TERMINATE_TOOLS:
            invoke(db, action.name, action.kwargs)
    return db


def outputs_found(outputs: Sequence[str], replies: Sequence[str]) -> dict[str, bool]:
    """For each expected output: is it (lowercased) in some reply (lowercased, commas removed)?"""
    normalized = [reply.lower().replace(",", "") for reply in replies]
    return {output: any(output.lower() in reply for reply in normalized) for output in outputs}


def compute_reward(
    db: Mapping[str, dict[str, Record]], data: RetailData, task: Task, replies: Sequence[str]
) -> RewardInfo:
    """Score the episode that left ``db`` behind and said ``replies`` to the user (see module doc)."""
    differing = diff_databases(db, goal_database(data, task))
    found = outputs_found(task.outputs, replies)
    r_actions = 0.0 if differing else 1.0
    r_outputs = 1.0 if all(found.values()) else 0.0
    return RewardInfo(
        reward=r_actions * r_outputs,
        r_actions=r_actions,
        r_outputs=r_outputs,
        outputs=found,
        differing_records=differing,
    )


def reward_metrics(info: RewardInfo) -> dict[str, Any]:
    """The reward info as flat episode metrics (numbers average across episodes; strings are per episode)."""
    return {
        "reward": info.reward,
        "r_actions": info.r_actions,
        "r_outputs": info.r_outputs,
        "failed_actions": float("actions" in info.failed_checks),
        "failed_outputs": float("outputs" in info.failed_checks),
        "outputs_found": sum(info.outputs.values()),
        "outputs_expected": len(info.outputs),
        "differing_records": ",".join(info.differing_records),
    }
