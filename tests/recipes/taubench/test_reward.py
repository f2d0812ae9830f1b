"""Tests of ``skyrl_clora.recipes.taubench.reward``: tau-bench's reward, 1.0 iff the episode's database equals the
goal database (the ground-truth actions replayed, a transfer skipped) and every expected output appears in a reply
(lowercased, commas removed from the replies); which checks failed and why; and the flat episode metrics."""

from __future__ import annotations

from pathlib import Path

from skyrl_clora.recipes.taubench.data import Action, Task, load_retail_data, load_tasks
from skyrl_clora.recipes.taubench.reward import RewardInfo, compute_reward, goal_database, outputs_found, reward_metrics
from skyrl_clora.recipes.taubench.tools import invoke
from tests.support.taubench_retail import data_dir  # noqa: F401 (data_dir: a fixture)


def test_goal_database_and_reward(data_dir: Path) -> None:
    data = load_retail_data(data_dir)
    task = load_tasks(data_dir, "test")[0]
    info = compute_reward(data.fresh_db(), data, task, ["It cost $102.50", "Total: 102.5"])
    assert (info.reward, info.failed_checks, info.outputs) == (1.0, [], {"102.5": True})
    info = compute_reward(data.fresh_db(), data, task, ["It cost 1,02.5?"])
    assert info.reward == 1.0  # commas are removed from the replies before matching
    info = compute_reward(data.fresh_db(), data, task, ["It cost one hundred and two"])
    assert (info.reward, info.failed_checks) == (0.0, ["outputs"])
    cancel = load_tasks(data_dir, "train")[0]
    assert goal_database(data, cancel)["orders"]["#W1000001"]["status"] == "cancelled"
    info = compute_reward(data.fresh_db(), data, cancel, ["done"])
    assert (info.reward, info.failed_checks, info.differing_records) == (0.0, ["actions"], ["orders/#W1000001"])


def test_outputs_are_matched_case_blind_with_commas_removed_from_replies_only() -> None:
    found = outputs_found(["Blue", "1,000", "42"], ["I picked BLUE.", "That is 1,000 dollars", "Total: 4 2"])
    assert found == {"Blue": True, "1,000": False, "42": False}
    assert outputs_found(["1000"], ["That is 1,000 dollars"]) == {"1000": True}
    assert outputs_found([], ["anything"]) == {}


def test_the_goal_skips_a_transfer_and_a_task_without_outputs_needs_none(data_dir: Path) -> None:
    data = load_retail_data(data_dir)
    transfer = load_tasks(data_dir, "test")[2]
    assert transfer.actions[-1].name == "transfer_to_human_agents"
    assert compute_reward(data.fresh_db(), data, transfer, []).reward == 1.0
    arguments = {"order_id": "#W1000001", "reason": "no longer needed"}
    cancel = Task("ada_lovelace_1001", "cancel", (Action("cancel_pending_order", arguments),), ())
    db = data.fresh_db()
    invoke(db, "cancel_pending_order", arguments)
    info = compute_reward(db, data, cancel, [])
    assert (info.reward, info.r_actions, info.r_outputs, info.outputs, info.failed_checks) == (1.0, 1.0, 1.0, {}, [])
    assert goal_database(data, cancel)["orders"]["#W1000001"] == db["orders"]["#W1000001"]


def test_reward_metrics_are_flat() -> None:
    info = RewardInfo(reward=0.0, r_actions=0.0, r_outputs=0.0, outputs={"a": True, "b": False},
                      differing_records=["orders/#W1", "users/u"])
    assert info.failed_checks == ["actions", "outputs"]
    assert reward_metrics(info) == {
        "reward": 0.0, "r_actions": 0.0, "r_outputs": 0.0, "failed_actions": 1.0, "failed_outputs": 1.0,
        "outputs_found": 1, "outputs_expected": 2, "differing_records": "orders/#W1,users/u",
    }
    assert reward_metrics(RewardInfo(1.0, 1.0, 1.0))["failed_actions"] == 0.0
