"""``tinker-cookbook``'s own minimal loops, ``recipes.sl_loop`` (supervised, cross_entropy) and ``recipes.rl_loop``
(GRPO-style: sample -> reward -> importance_sampling -> optim_step), unchanged, against ``python -m
skyrl_clora.tinker.server`` on the micro model (CPU).

What differs from a run against Thinking Machines' service is only what the done-when allows: the base URL, the key
(``TINKER_API_KEY``) and the model. The model is the micro model in a folder named ``Qwen/Qwen3-8B`` in the loop's
working folder: the cookbook picks its renderer by such a name (``model_info``) and loads the tokenizer from the folder
of that path. The hub datasets the loops load by name (``HuggingFaceH4/no_robots``, ``openai/gsm8k``) are GSM8K-format
problems written into a local datasets cache. Sizes (batch, steps, rank, learning rate) are the loops' own options.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyrl_clora.recipes.gsm8k.problems import Problem, generate_problems
from tests.support.tinker_cookbook import cookbook_python, run_recipe, write_hub_dataset
from tests.tinker.conftest import TinkerServer, serve_clora

pytestmark = pytest.mark.e2e
MODEL_NAME = "Qwen/Qwen3-8B"  # a name in the cookbook's model table: its renderer is ``qwen3``, stop tokens by id


@pytest.fixture(scope="module")
def workspace(micro_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The loops' working folder: the micro model as ``Qwen/Qwen3-8B`` and the datasets cache ``hf-datasets``."""
    folder = tmp_path_factory.mktemp("cookbook")
    shutil.copytree(micro_model_dir, folder / MODEL_NAME)
    cache = folder / "hf-datasets"
    splits = {split: generate_problems(n, seed=0, split=split) for split, n in (("train", 64), ("test", 16))}
    write_hub_dataset(cache, "openai/gsm8k", "main", {
        split: [{"question": p.question, "answer": p.answer_text} for p in problems]
        for split, problems in splits.items()})
    write_hub_dataset(cache, "HuggingFaceH4/no_robots", "default", {
        split: [_chat_row(i, p) for i, p in enumerate(problems)] for split, problems in splits.items()})
    return folder


def _chat_row(index: int, problem: Problem) -> dict[str, object]:
    """A row in no_robots' columns: the question and its GSM8K-style solution as a conversation."""
    messages = [{"role": "user", "content": problem.question}, {"role": "assistant", "content": problem.answer_text}]
    return {"prompt": problem.question, "prompt_id": str(index), "messages": messages, "category": "Math"}


@pytest.fixture(scope="module")
def cookbook_server(workspace: Path) -> Iterator[TinkerServer]:
    server = workspace / "server"
    server.mkdir()
    yield from serve_clora(workspace / MODEL_NAME, server, max_sequence_length=512)


def _run(recipe: str, workspace: Path, server: TinkerServer, log_path: Path, **options: object) -> None:
    """Runs ``recipe`` in ``workspace`` against ``server``, writing its logs to ``log_path``; fails with its output."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(workspace / "hf-datasets"), "TINKER_API_KEY": server.key,
           "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1"}
    done = run_recipe(cookbook_python(), recipe, workspace, env, base_url=server.url, model_name=MODEL_NAME,
                      log_path=log_path, lora_rank=8, **options)
    assert done.returncode == 0, f"{recipe} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_cookbook_sl_loop_learns_and_resumes_from_its_checkpoint_as_if_uninterrupted(
        workspace: Path, cookbook_server: TinkerServer) -> None:
    log = workspace / "sl-loop"
    options = {"batch_size": 8, "max_steps": 6, "save_every": 3, "learning_rate": 1e-2}
    _run("sl_loop", workspace, cookbook_server, log, **options)
    first = {row["step"]: row["train_mean_nll"] for row in _jsonl(log / "metrics.jsonl")}
    checkpoints = _jsonl(log / "checkpoints.jsonl")
    assert sorted(first) == list(range(6))
    assert first[5] < 0.8 * first[0]
    assert [c["name"] for c in checkpoints] == ["000003", "final"]
    assert checkpoints[1]["sampler_path"].startswith("tinker://")

    # As a crash just after the step-3 checkpoint leaves it: the loop resumes from that state (weights and Adam
    # moments, ``create_training_client_from_state_with_optimizer``) on a new model and repeats steps 3-5.
    (log / "checkpoints.jsonl").write_text(json.dumps(checkpoints[0]) + "\n")
    (log / "metrics.jsonl").rename(log / "metrics-first.jsonl")
    _run("sl_loop", workspace, cookbook_server, log, **options)
    resumed = {row["step"]: row["train_mean_nll"] for row in _jsonl(log / "metrics.jsonl")}
    assert resumed == pytest.approx({step: first[step] for step in (3, 4, 5)}, rel=1e-6)


def test_the_cookbook_rl_loop_samples_groups_and_saves_its_final_checkpoint(
        workspace: Path, cookbook_server: TinkerServer) -> None:
    """The micro model earns no reward on ``\\boxed{}`` answers, so the loop's steps skip training (all advantages
    zero): what runs here is its sampling (groups of 4 under the qwen3 renderer's stop token) and its checkpoints."""
    log = workspace / "rl-loop"
    _run("rl_loop", workspace, cookbook_server, log, batch_size=4, group_size=4, max_steps=2, max_tokens=16)
    metrics = _jsonl(log / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1]
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in metrics)
    final = _jsonl(log / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["sampler_path"].startswith("tinker://")
