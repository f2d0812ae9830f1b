"""A run's tenants as Tinker clients (``skyrl_clora.tinker.recipe_clients``): the datum an episode becomes, and runs
of the micro task through the real SDK against ``python -m skyrl_clora.tinker.server`` (``clora`` backend) on the
learnable micro model, CPU: the clients learn, their samples differ, and each client's run is the same whether it
ran beside the other or alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skyrl_clora.run_shell import prepare
from skyrl_clora.tinker.recipe_clients import STATE_FILE, ppo_datum, run_recipe_clients
from skyrl_clora.trainer.batch import TrainBatch
from tests.support.micro_task import micro_tenants, roll_back, run_args
from tests.tinker.conftest import TinkerServer


def test_an_episode_becomes_a_datum_that_trains_only_its_sampled_tokens() -> None:
    batch = TrainBatch(prompt_ids=[[1, 2, 3]], response_ids=[[4, 5, 6, 7]], loss_masks=[[1, 1, 0, 1]], rewards=[1.0],
                       group_ids=["g"], rollout_logprobs=[[-0.1, -0.2, -0.3, -0.4]])
    datum = ppo_datum(batch, [0.5, 0.5, 0.5, 0.5, 0.0], 0)
    inputs = {key: list(value.data) for key, value in datum.loss_fn_inputs.items()}
    assert datum.model_input.to_ints() == [1, 2, 3, 4, 5, 6]
    assert inputs["target_tokens"] == [2, 3, 4, 5, 6, 7]
    assert inputs["weights"] == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert inputs["advantages"] == [0.0, 0.0, 0.5, 0.5, 0.0, 0.5]
    assert inputs["logprobs"] == pytest.approx([0.0, 0.0, -0.1, -0.2, 0.0, -0.4])


def _run(server: TinkerServer, out: Path, *extra: str) -> list[dict[str, Any]]:
    tenants = micro_tenants({"name": "a", "seed": 1}, {"name": "b", "seed": 2})
    prepared = prepare(run_args(Path(server.base_model), out, tenants, *extra, steps=4))
    outcome = run_recipe_clients(prepared.run, prepared.sources, prepared.resume, server.url, server.key,
                                 server.base_model)
    return outcome.records


def _by_tenant(records: list[dict[str, Any]], event: str) -> dict[str, list[dict[str, Any]]]:
    """Each tenant's records of ``event``, timings (``*_s``, SkyRL's ``*trajectory_time*``) left out."""
    kept: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record["event"] == event:
            kept.setdefault(record["tenant"], []).append(
                {key: value for key, value in record.items() if not (key.endswith("_s") or "_time_" in key)})
    return kept


@pytest.mark.e2e
def test_tinker_clients_learn_the_micro_task_beside_each_other_as_alone(learning_clora_server: TinkerServer,
                                                                       tmp_path: Path) -> None:
    together = _run(learning_clora_server, tmp_path / "together")
    alone = _run(learning_clora_server, tmp_path / "alone", "clora.mode=serial")
    steps = _by_tenant(together, "step")
    assert steps["a"][0]["reward_mean"] != steps["b"][0]["reward_mean"]  # the clients' samples differ
    for tenant, records in steps.items():
        assert all(record["train/skyrl.ai/grad_norm"] > 0 for record in records)
        assert records[-1]["reward_mean"] > records[0]["reward_mean"] + 0.05, (tenant, records)
    assert steps == _by_tenant(alone, "step")
    assert _by_tenant(together, "eval") == _by_tenant(alone, "eval")
    exported = json.loads((tmp_path / "together" / "adapters" / "a" / STATE_FILE).read_text())
    assert exported["version"] == 4 and exported["sampler_weights"].startswith("tinker://")


@pytest.mark.e2e
def test_tinker_clients_resume_from_their_checkpoints_as_if_never_stopped(learning_clora_server: TinkerServer,
                                                                         tmp_path: Path) -> None:
    """Both clients rolled back to their step-2 checkpoints (the server's saved state with Adam's moments): the same
    command reloads them and ends each client's run as the uninterrupted one did."""
    args = ("trainer.ckpt_interval=1", "trainer.max_ckpts_to_keep=4")
    whole = _run(learning_clora_server, tmp_path, *args)
    for tenant in ("a", "b"):
        roll_back(tmp_path, tenant, 2)
    resumed = _run(learning_clora_server, tmp_path, *args)
    rollouts = {when: {(r["tenant"], r["step"]): r["rollout_s"] for r in records if r["event"] == "step"}
                for when, records in (("whole", whole), ("resumed", resumed))}
    assert sorted(rollouts["resumed"]) == [(tenant, step) for tenant in "ab" for step in (1, 2, 3, 4)]
    for key, seconds in rollouts["whole"].items():  # steps 1-2 carried over, timings included; 3-4 run again
        assert (rollouts["resumed"][key] == seconds) == (key[1] <= 2), key
    assert _by_tenant(resumed, "step")["a"][2] != _by_tenant(resumed, "step")["b"][2]
    assert _by_tenant(resumed, "step") == _by_tenant(whole, "step")
    assert _by_tenant(resumed, "eval") == _by_tenant(whole, "eval")
