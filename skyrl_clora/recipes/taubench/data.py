"""Loading a tau-bench retail data folder: the database, the policy document and the tasks.

A data folder holds ``users.json``, ``orders.json``, ``products.json`` (the database tables, each a JSON
object keyed by record id), ``wiki.md`` (the agent policy) and one ``tasks_<split>.json`` per split
(a JSON list of ``{"user_id", "instruction", "actions": [{"name", "kwargs"}], "outputs": [str]}``).
The real benchmark's folder is converted from sierra-research/tau-bench; :mod:`.synthetic` writes a
small one for tests.

Files are parsed once per process and folder (:func:`load_retail_data`, :func:`load_tasks`); each
episode then takes :meth:`RetailData.fresh_db`, which behaves as a fresh deep copy of the database.
"""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from skyrl_clora.recipes.taubench.db import TABLES, Database, Record, fresh_database

POLICY_FILE = "wiki.md"
ENV_CLASS = "taubench_retail"
SPLITS: tuple[str, ...] = ("train", "test", "dev")


@dataclass(frozen=True)
class Action:
    """One ground-truth tool call of a task: the tool's ``name`` and its keyword arguments."""

    name: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Task:
    """A retail task: the customer (``user_id``), what the simulated user is told to do
    (``instruction``), the ground-truth ``actions`` whose replay defines the goal database, and the
    ``outputs`` that must appear in the agent's replies."""

    user_id: str
    instruction: str
    actions: tuple[Action, ...]
    outputs: tuple[str, ...]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Task:
        """Build a task from its JSON form; ValueError naming the missing or malformed field."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"a task must be a JSON object, got {type(raw).__name__}")
        for field in ("user_id", "instruction", "actions"):
            if field not in raw:
                raise ValueError(f"task is missing the field {field!r}")
        actions = []
        for position, action in enumerate(raw["actions"]):
            if not isinstance(action, Mapping) or not isinstance(action.get("name"), str):
                raise ValueError(f"task action {position} must be an object with a string 'name'")
            kwargs = action.get("kwargs", {})
            if not isinstance(kwargs, Mapping):
                raise ValueError(f"task action {position} ({action['name']}) has non-object kwargs")
            actions.append(Action(name=action["name"], kwargs=dict(kwargs)))
        outputs = raw.get("outputs") or ()
        if isinstance(outputs, str) or not all(isinstance(output, str) for output in outputs):
            raise ValueError("task outputs must be a list of strings")
        return cls(
            user_id=str(raw["user_id"]),
            instruction=str(raw["instruction"]),
            actions=tuple(actions),
            outputs=tuple(outputs),
        )


@dataclass(frozen=True)
class RetailData:
    """The parsed database and policy of one data folder. ``tables`` is shared and never mutated."""

    path: Path
    tables: Mapping[str, Mapping[str, Record]]
    policy: str

    def fresh_db(self) -> Database:
        """A new episode database, equivalent to a deep copy of ``tables`` (copy-on-write)."""
        return fresh_database(self.tables)


def _require(folder: Path, name: str) -> Path:
    """``folder/name``, or a one-line ValueError naming the missing file."""
    path = folder / name
    if not path.is_file():
        raise ValueError(f"tau-bench retail data folder {folder} has no {name}")
    return path


def _resolve(path: str | Path) -> Path:
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"tau-bench retail data folder {folder} does not exist")
    return folder


def load_retail_data(path: str | Path) -> RetailData:
    """The database and policy of the data folder at ``path`` (parsed once per process and folder)."""
    return _load_retail_data(_resolve(path))


@functools.lru_cache(maxsize=None)
def _load_retail_data(folder: Path) -> RetailData:
    tables: dict[str, Mapping[str, Record]] = {}
    for name in TABLES:
        file = _require(folder, f"{name}.json")
        table = json.loads(file.read_text())
        if not isinstance(table, dict):
            raise ValueError(f"{file} must hold a JSON object keyed by record id")
        tables[name] = table
    policy = _require(folder, POLICY_FILE).read_text()
    return RetailData(path=folder, tables=tables, policy=policy)


def load_tasks(path: str | Path, split: str) -> tuple[Task, ...]:
    """The tasks of ``split`` (``tasks_<split>.json``) in the data folder at ``path``, parsed once."""
    if split not in SPLITS:
        raise ValueError(f"unknown tau-bench task split {split!r}; expected one of {', '.join(SPLITS)}")
    return _load_tasks(_resolve(path), split)


@functools.lru_cache(maxsize=None)
def _load_tasks(folder: Path, split: str) -> tuple[Task, ...]:
    file = _require(folder, f"tasks_{split}.json")
    raw = json.loads(file.read_text())
    if not isinstance(raw, list):
        raise ValueError(f"{file} must hold a JSON list of tasks")
    tasks = []
    for index, entry in enumerate(raw):
        try:
            tasks.append(Task.from_dict(entry))
        except ValueError as error:
            raise ValueError(f"{file} task {index}: {error}") from None
    return tuple(tasks)


def resolve_task(path: str | Path, task: Any = None, split: str = "train", index: Any = None) -> Task:
    """The episode's task: ``task`` given inline (a task dict or a :class:`Task`), or task number
    ``index`` of ``split`` in the data folder. Exactly one of ``task`` and ``index`` must be given."""
    if (task is None) == (index is None):
        raise ValueError("give the tau-bench task either inline ('task') or by number ('task_index'), not both")
    if task is not None:
        return task if isinstance(task, Task) else Task.from_dict(task)
    try:
        position = operator.index(index)
    except TypeError:
        raise ValueError(f"task_index must be an integer, got {index!r}") from None
    tasks = load_tasks(path, split)
    if not 0 <= position < len(tasks):
        raise ValueError(f"task_index {position} is out of range for the {len(tasks)} {split} tasks")
    return tasks[position]


def dataset_rows(path: str | Path, split: str) -> list[dict[str, Any]]:
    """SkyRL dataset rows (``prompt``, ``env_class`` and the env's extras) for the tasks of ``split``.

    The prompt is only the policy as a system message (the environment's ``init`` replaces it with the
    policy and the tool signatures, then adds the customer's first message); the task's instruction is
    never in the prompt, since it is the simulated customer's secret. The other keys reach the
    environment as ``extras``: ``data_path`` (absolute), ``task_split`` and ``task_index``.
    """
    data = load_retail_data(path)
    return [
        {
            "prompt": [{"role": "system", "content": data.policy}],
            "env_class": ENV_CLASS,
            "data_path": str(data.path),
            "task_split": split,
            "task_index": index,
        }
        for index in range(len(load_tasks(path, split)))
    ]
