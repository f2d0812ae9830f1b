"""Tests of ``skyrl_clora.recipes.taubench.data``: loading a retail data folder (a missing file or an unknown split
named in one line), tasks parsed and validated field by field, an episode's task resolved inline or by number, and
the SkyRL dataset rows of a split driving the registered environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import skyrl_gym

from skyrl_clora.recipes.taubench.data import Action, Task, dataset_rows, load_retail_data, load_tasks, resolve_task
from skyrl_clora.recipes.taubench.env import register_taubench_env
from skyrl_clora.recipes.taubench.synthetic import make_synthetic_retail
from tests.support.taubench_retail import data_dir, tool_call  # noqa: F401 (data_dir: a fixture)


def test_dataset_rows_drive_the_registered_env(data_dir: Path) -> None:
    register_taubench_env()
    rows = dataset_rows(data_dir, "test")
    assert [row["task_index"] for row in rows] == [0, 1, 2, 3]
    row = dict(rows[3])
    prompt, env_class = row.pop("prompt"), row.pop("env_class")
    assert prompt == [{"role": "system", "content": load_retail_data(data_dir).policy}]
    env = skyrl_gym.make(env_class, env_config={"scripted_user": {"max_replies": 1}}, extras={**row, "max_turns": 4})
    conversation, _ = env.init(prompt)
    assert len(conversation) == 2 and conversation[1]["content"] == load_tasks(data_dir, "test")[3].instruction
    env.step(tool_call("calculate", {"expression": "80.0 + 95.99"}))
    assert env.step("Together they cost $175.99.")["reward"] == 1.0


def test_incomplete_data_folder_names_the_missing_file(tmp_path: Path) -> None:
    folder = make_synthetic_retail(tmp_path / "retail")
    (folder / "orders.json").unlink()
    with pytest.raises(ValueError, match=r"has no orders\.json$"):
        load_retail_data(folder)
    with pytest.raises(ValueError, match=r"has no tasks_dev\.json$"):
        load_tasks(folder, "dev")
    with pytest.raises(ValueError, match="unknown tau-bench task split 'valid'"):
        load_tasks(folder, "valid")
    with pytest.raises(ValueError, match="does not exist"):
        load_retail_data(tmp_path / "nowhere")


def test_resolve_task_inline_or_by_index(data_dir: Path) -> None:
    inline = {"user_id": "u", "instruction": "do", "actions": [{"name": "think", "kwargs": {"thought": "t"}}]}
    assert resolve_task(data_dir, task=inline).outputs == ()
    assert resolve_task(data_dir, split="test", index=3).outputs == ("175.99",)
    with pytest.raises(ValueError, match="out of range"):
        resolve_task(data_dir, split="test", index=4)
    with pytest.raises(ValueError, match="not both"):
        resolve_task(data_dir, task=inline, index=0)
    with pytest.raises(ValueError, match="missing the field 'instruction'"):
        resolve_task(data_dir, task={"user_id": "u", "actions": []})


def test_a_task_parses_from_its_json_form() -> None:
    task = Task.from_dict({"user_id": 7, "instruction": "do", "outputs": None,
                           "actions": [{"name": "think", "kwargs": {"thought": "t"}}, {"name": "calculate"}]})
    assert task == Task("7", "do", (Action("think", {"thought": "t"}), Action("calculate", {})), ())


@pytest.mark.parametrize(("raw", "message"), [
    (["not", "a", "dict"], "a task must be a JSON object, got list"),
    ({"user_id": "u", "instruction": "i"}, "task is missing the field 'actions'"),
    ({"user_id": "u", "instruction": "i", "actions": [{"kwargs": {}}]},
     "task action 0 must be an object with a string 'name'"),
    ({"user_id": "u", "instruction": "i", "actions": [{"name": "think"}, {"name": "calculate", "kwargs": [1]}]},
     r"task action 1 \(calculate\) has non-object kwargs"),
    ({"user_id": "u", "instruction": "i", "actions": [], "outputs": "12"}, "task outputs must be a list of strings"),
    ({"user_id": "u", "instruction": "i", "actions": [], "outputs": [12]}, "task outputs must be a list of strings"),
])
def test_a_malformed_task_names_what_is_wrong(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Task.from_dict(raw)


def test_a_malformed_tasks_file_names_the_task(tmp_path: Path) -> None:
    folder = make_synthetic_retail(tmp_path / "retail")
    (folder / "tasks_dev.json").write_text('[{"user_id": "u", "instruction": "i", "actions": []}, {"user_id": "u"}]')
    with pytest.raises(ValueError, match=r"tasks_dev\.json task 1: task is missing the field 'instruction'"):
        load_tasks(folder, "dev")
    (folder / "orders.json").write_text("[]")
    with pytest.raises(ValueError, match=r"orders\.json must hold a JSON object keyed by record id"):
        load_retail_data(folder)


def test_files_are_parsed_once_per_folder(data_dir: Path) -> None:
    assert load_retail_data(data_dir) is load_retail_data(str(data_dir) + "/")
    assert load_tasks(data_dir, "train") is load_tasks(data_dir, "train")
    data = load_retail_data(data_dir)
    assert data.path == data_dir.resolve() and data.policy.startswith("# Retail agent policy (synthetic)")
    assert sorted(data.tables) == ["orders", "products", "users"] and len(data.tables["orders"]) == 7


def test_a_task_number_must_be_an_integer(data_dir: Path) -> None:
    with pytest.raises(ValueError, match="task_index must be an integer, got '1'"):
        resolve_task(data_dir, split="test", index="1")
    task = load_tasks(data_dir, "train")[1]
    assert resolve_task(data_dir, task=task) is task and resolve_task(data_dir, index=1) is task  # split: train


def test_dataset_rows_keep_the_instruction_out_of_the_prompt(data_dir: Path) -> None:
    rows = dataset_rows(data_dir, "train")
    assert len(rows) == len(load_tasks(data_dir, "train")) == 7
    assert rows[2] == {"prompt": [{"role": "system", "content": load_retail_data(data_dir).policy}],
                       "env_class": "taubench_retail", "data_path": str(data_dir.resolve()), "task_split": "train",
                       "task_index": 2}
    instructions = [task.instruction for task in load_tasks(data_dir, "train")]
    assert not any(instruction in str(rows) for instruction in instructions)
