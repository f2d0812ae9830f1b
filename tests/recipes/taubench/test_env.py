"""Tests of ``skyrl_clora.recipes.taubench.env``: the ``taubench_retail`` skyrl-gym environment's episodes through
init/step (the system prompt with policy and tools, tool calls run in order on the episode's database, replies
answered by the simulated customer), what ends an episode (the customer's stop, a transfer, ``max_turns``), the
reward and its metrics, its settings, and its registration with skyrl-gym.

Most tests run on the project's synthetic data folder. ``test_real_*`` replay the ground truth of the
real tau-bench retail tasks from ``<repo>/../shared/data/taubench_retail`` and are skipped without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import skyrl_gym

from skyrl_clora.recipes.taubench.data import Task, load_retail_data, load_tasks
from skyrl_clora.recipes.taubench.env import ENV_ID, TauBenchRetailEnv, register_taubench_env
from skyrl_clora.recipes.taubench.schemas import TOOL_SCHEMAS
from skyrl_clora.recipes.taubench.tools import TERMINATE_TOOLS, invoke
from tests.support.taubench_retail import data_dir, make_env, tool_call  # noqa: F401 (data_dir: a fixture)


REAL_DATA = Path(__file__).resolve().parents[4] / "shared" / "data" / "taubench_retail"
needs_real_data = pytest.mark.skipif(
    not (REAL_DATA / "tasks_train.json").is_file(), reason=f"real tau-bench retail data not found at {REAL_DATA}"
)


def replay(env: TauBenchRetailEnv, task: Task, final_reply: str) -> dict[str, Any]:
    """Play the task's ground truth: its tool calls, ``final_reply`` to the user, then a terminating call
    (transfer) if the task ends with one. Returns the final step's output."""
    env.init([])
    output: dict[str, Any] = {}
    for action in task.actions:
        if action.name not in TERMINATE_TOOLS:
            output = env.step(tool_call(action.name, action.kwargs))
            assert not output["done"]
    output = env.step(final_reply)
    for action in task.actions:
        if action.name in TERMINATE_TOOLS:
            output = env.step(tool_call(action.name, action.kwargs))
    assert output["done"]
    return output


def users_for(task: Task) -> dict[str, Any]:
    """A scripted user that stops on the final reply, or after it when a transfer still follows."""
    transfers = any(action.name in TERMINATE_TOOLS for action in task.actions)
    return {"max_replies": 2 if transfers else 1}


def test_init_puts_policy_and_tools_in_the_system_prompt(data_dir: Path) -> None:
    env = make_env(data_dir, task_index=0)
    conversation, _ = env.init([{"role": "system", "content": "replaced"}, {"role": "user", "content": "context"}])
    system = conversation[0]["content"]
    assert conversation[0]["role"] == "system" and system.startswith("# Retail agent policy (synthetic)")
    assert "\n\n# Tools\n\nYou may call one or more functions" in system
    assert json.dumps(TOOL_SCHEMAS[0]) in system and system.endswith("</tool_call>")
    assert conversation[1:] == [
        {"role": "user", "content": "context"},
        {"role": "user", "content": load_tasks(data_dir, "train")[0].instruction},
    ]


def test_scripted_episode_end_to_end(data_dir: Path) -> None:
    env = make_env(data_dir, task_index=0, scripted_user={"max_replies": 3, "stop_phrases": ["anything else"]})
    env.init([])
    out = env.step(tool_call("find_user_id_by_email", {"email": "ada.lovelace@example.com"}))
    assert out["observations"] == [{"role": "tool", "content": "ada_lovelace_1001"}] and not out["done"]
    out = env.step("<think>I must confirm first.</think>Shall I cancel #W1000001?<|im_end|>")
    assert out["observations"] == [{"role": "user", "content": "Yes, please go ahead."}]
    assert out["reward"] == 0.0 and not out["done"]
    out = env.step(tool_call("cancel_pending_order", {"order_id": "#W1000001", "reason": "no longer needed"}))
    assert json.loads(out["observations"][0]["content"])["status"] == "cancelled"
    out = env.step("Cancelled. Anything else?")
    assert out["done"] and out["reward"] == 1.0 and out["observations"] == []
    assert env.replies == ["Shall I cancel #W1000001?", "Cancelled. Anything else?"]
    metrics = env.get_metrics()
    assert metrics["failed_check"] == "" and metrics["ended_by"] == "user_stop"
    assert (metrics["turns"], metrics["tool_calls"], metrics["tool_errors"], metrics["agent_replies"]) == (4, 2, 0, 2)
    assert out["metadata"] == metrics
    with pytest.raises(RuntimeError, match="already ended"):
        env.step("hello?")


def test_missing_output_gives_zero_and_names_the_check(data_dir: Path) -> None:
    task = load_tasks(data_dir, "test")[0]
    env = make_env(data_dir, task_split="test", task_index=0, scripted_user={"max_replies": 1})
    out = replay(env, task, "Your order cost a hundred and two dollars and fifty cents.")
    metrics = env.get_metrics()
    assert out["reward"] == 0.0
    assert (metrics["failed_check"], metrics["r_actions"], metrics["r_outputs"]) == ("outputs", 1.0, 0.0)
    assert (metrics["outputs_found"], metrics["outputs_expected"]) == (0, 1)
    env = make_env(data_dir, task_split="test", task_index=0, scripted_user={"max_replies": 1})
    assert replay(env, task, "Your order cost $102.5.")["reward"] == 1.0


def test_wrong_database_gives_zero_and_names_the_check(data_dir: Path) -> None:
    env = make_env(data_dir, task_index=3, scripted_user={"max_replies": 1})
    env.init([])
    env.step(tool_call("exchange_delivered_order_items", {
        "order_id": "#W1000005", "item_ids": ["2000000013"], "new_item_ids": ["2000000011"],
        "payment_method_id": "credit_card_1003"}))
    out = env.step("Exchange requested.")
    metrics = env.get_metrics()
    assert out["reward"] == 0.0 and metrics["failed_check"] == "actions"
    assert metrics["differing_records"] == "orders/#W1000005" and metrics["failed_actions"] == 1.0


@pytest.mark.parametrize(
    ("output", "error"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "Error: invalid tool call: not JSON"),
        ('<tool_call>\n{"name": "think", "arguments": {"thought": "x"}}',
         "Error: invalid tool call: missing </tool_call>"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'Error: invalid tool call: expected {"name"'),
        ('<tool_call>\n["think"]\n</tool_call>', 'Error: invalid tool call: expected {"name"'),
        ('<tool_call>\n{"name": "think", "arguments": [1]}\n</tool_call>',
         "Error: invalid tool call: arguments must be"),
        ('<tool_call>\n{"name": "think", "arguments": "{oops"}\n</tool_call>',
         "Error: invalid tool call: arguments are not"),
        ('<tool_call>\n{"name": "refund_everything", "arguments": {}}\n</tool_call>',
         "Unknown action refund_everything"),
        ('<tool_call>\n{"name": "think", "arguments": {}}\n</tool_call>', "Error: "),
    ],
)
def test_malformed_tool_calls_give_error_observations(data_dir: Path, output: str, error: str) -> None:
    env = make_env(data_dir, task_index=0)
    env.init([])
    out = env.step(output)
    assert not out["done"] and len(out["observations"]) == 1
    assert out["observations"][0]["role"] == "tool" and out["observations"][0]["content"].startswith(error)
    assert env.get_metrics()["tool_errors"] == 1 and env.replies == []


def test_several_calls_in_one_message_run_in_order(data_dir: Path) -> None:
    env = make_env(data_dir, task_index=0)
    env.init([])
    out = env.step(
        "Let me look.\n" + tool_call("find_user_id_by_email", {"email": "grace.hopper@example.com"}) + "\n"
        + tool_call("get_user_details", {"user_id": "grace_hopper_1003"}) + "\n"
        + '<tool_call>\n{"name": "list_all_product_types", "arguments": "{}"}\n</tool_call>'
    )
    contents = [message["content"] for message in out["observations"]]
    assert contents[0] == "grace_hopper_1003" and json.loads(contents[1])["orders"][0] == "#W1000005"
    assert json.loads(contents[2])["T-Shirt"] == "1000000001"
    assert env.get_metrics()["tool_calls"] == 3 and env.replies == []


def test_compact_tool_calls_without_newlines_parse(data_dir: Path) -> None:
    env = make_env(data_dir, task_index=0)
    env.init([])
    out = env.step('<tool_call>{"name":"get_user_details","arguments":{"user_id":"alan_turing_1002"}}</tool_call>')
    assert json.loads(out["observations"][0]["content"])["email"] == "alan.turing@example.com"


def test_tool_calls_inside_reasoning_are_ignored(data_dir: Path) -> None:
    env = make_env(data_dir, task_index=0, scripted_user={"max_replies": 2})
    env.init([])
    cancel = tool_call("cancel_pending_order", {"order_id": "#W1000001", "reason": "no longer needed"})
    out = env.step(f"<think>{cancel}</think>Please confirm your email.")
    assert out["observations"][0]["role"] == "user" and env.tool_calls == 0
    assert env.db["orders"]["#W1000001"]["status"] == "pending"


def test_transfer_ends_the_episode(data_dir: Path) -> None:
    env = make_env(data_dir, task_split="test", task_index=2)
    env.init([])
    env.step(tool_call("find_user_id_by_name_zip", {"first_name": "Alan", "last_name": "Turing", "zip": "02108"}))
    transfer = tool_call("transfer_to_human_agents", {"summary": "wants a cancel"})
    out = env.step(transfer + tool_call("think", {"thought": "x"}))
    assert out["done"] and out["reward"] == 1.0 and out["observations"] == []
    assert env.get_metrics()["ended_by"] == "transfer" and env.tool_calls == 2


def test_max_turns_truncates_with_zero_reward(data_dir: Path) -> None:
    env = make_env(data_dir, task_index=0, max_turns=2)
    env.init([])
    assert not env.step(tool_call("find_user_id_by_email", {"email": "ada.lovelace@example.com"}))["done"]
    out = env.step(tool_call("cancel_pending_order", {"order_id": "#W1000001", "reason": "no longer needed"}))
    metrics = env.get_metrics()
    assert out["done"] and out["reward"] == 0.0 and metrics["reward"] == 0.0
    assert metrics["failed_check"] == "max_turns" and metrics["r_actions"] == 1.0 and metrics["truncated"] == 1.0


def test_settings_errors_are_one_line(data_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs data_path"):
        TauBenchRetailEnv(env_config=None, extras={"task_index": 0})
    with pytest.raises(ValueError, match="unknown tau-bench user 'human'"):
        make_env(data_dir, task_index=0, user="human")
    with pytest.raises(ValueError, match="max_replies must be at least 1"):
        make_env(data_dir, task_index=0, scripted_user={"max_replies": 0})
    with pytest.raises(ValueError, match="either inline"):
        make_env(data_dir)


def test_registered_in_skyrl_gym(data_dir: Path) -> None:
    register_taubench_env()
    register_taubench_env()
    assert ENV_ID in skyrl_gym.registry
    env = skyrl_gym.make(ENV_ID, env_config={"data_path": str(data_dir), "max_turns": 5},
                         extras={"task_split": "test", "task_index": 1})
    assert isinstance(env, TauBenchRetailEnv) and env.max_turns == 5 and env.task.user_id == "grace_hopper_1003"


@needs_real_data
@pytest.mark.parametrize("split", ["train", "test"])
def test_real_ground_truth_replay_scores_one(split: str) -> None:
    data = load_retail_data(REAL_DATA)
    before = json.dumps(data.tables, sort_keys=True)
    tasks = load_tasks(REAL_DATA, split)
    assert len(tasks) == {"train": 500, "test": 115}[split]
    failures = []
    for index, task in enumerate(tasks):
        env = TauBenchRetailEnv(extras={"data_path": str(REAL_DATA), "task_split": split, "task_index": index,
                                        "max_turns": 100, "scripted_user": users_for(task)})
        out = replay(env, task, "Here is what I found: " + ", ".join(task.outputs))
        if out["reward"] != 1.0:
            failures.append((index, env.get_metrics()["failed_check"]))
    assert failures == []
    assert json.dumps(data.tables, sort_keys=True) == before, "an episode wrote into the shared base database"


def _perturbations(task: Task, tables: dict) -> list[tuple[str, Task]]:
    """Variants of the task's last database-changing action: another order of the same status, and
    for item changes another available variant of the same product."""
    order_writes = ("cancel", "modify_pending", "exchange", "return")
    writes = [i for i, action in enumerate(task.actions) if action.name.startswith(order_writes)]
    if not writes:
        return []
    position = writes[-1]
    action = task.actions[position]
    order = tables["orders"][action.kwargs["order_id"]]
    variants = []
    other = next(oid for oid, o in tables["orders"].items()
                 if o["status"] == order["status"] and oid != order["order_id"])
    variants.append(("wrong order", {**action.kwargs, "order_id": other}))
    if "new_item_ids" in action.kwargs:
        old = next(item for item in order["items"] if item["item_id"] == action.kwargs["item_ids"][0])
        choices = [vid for vid, v in tables["products"][old["product_id"]]["variants"].items()
                   if v["available"] and vid not in (action.kwargs["new_item_ids"][0], old["item_id"])]
        if choices:
            new_item_ids = [choices[0], *action.kwargs["new_item_ids"][1:]]
            variants.append(("wrong item", {**action.kwargs, "new_item_ids": new_item_ids}))
    perturbed = []
    for label, kwargs in variants:
        actions = list(task.actions)
        actions[position] = type(action)(name=action.name, kwargs=kwargs)
        perturbed.append((label, Task(task.user_id, task.instruction, tuple(actions), task.outputs)))
    return perturbed


@needs_real_data
def test_real_perturbed_actions_score_zero() -> None:
    data = load_retail_data(REAL_DATA)
    tasks = load_tasks(REAL_DATA, "train")[:60] + load_tasks(REAL_DATA, "test")
    checked = {"wrong order": 0, "wrong item": 0}
    for task in tasks:
        goal = data.fresh_db()
        observations = [invoke(goal, action.name, action.kwargs) for action in task.actions]
        if any(observation.startswith("Error") for observation in observations):
            continue  # a ground truth whose own call fails leaves nothing to perturb
        for label, wrong in _perturbations(task, data.tables):
            env = TauBenchRetailEnv(extras={"data_path": str(REAL_DATA), "task": task, "max_turns": 100,
                                            "scripted_user": users_for(task)})
            out = replay(env, wrong, "Here is what I found: " + ", ".join(task.outputs))
            assert out["reward"] == 0.0, (label, wrong)
            assert env.get_metrics()["failed_check"] == "actions"
            checked[label] += 1
    assert checked["wrong order"] >= 50 and checked["wrong item"] >= 20


def test_extras_override_env_config_and_none_values_are_unset(data_dir: Path) -> None:
    class Section:  # an attribute object, as a config section may be
        def __init__(self) -> None:
            self.data_path = str(data_dir)
            self.max_turns = 9
            self.task_split = "test"

    env = TauBenchRetailEnv(env_config=Section(), extras={"task_index": 1, "max_turns": None, "task_split": None})
    assert env.max_turns == 9 and env.task == load_tasks(data_dir, "test")[1]
    assert make_env(data_dir, task_index=0).max_turns == 30
    with pytest.raises(ValueError, match="max_turns must be at least 1, got 0"):
        make_env(data_dir, task_index=0, max_turns=0)
    with pytest.raises(ValueError, match="user_factory must be a callable"):
        make_env(data_dir, task_index=0, user_factory="scripted")
