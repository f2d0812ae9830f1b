"""The embedded backend's training step (skyrl_clora.backends.embedded.backend): it hands the trainer the sampler's
log-probs as the behaviour log-probs only in the Tinker-style step (``clora.step_style=tinker``), which then runs and
learns end to end through ``main``; and SkyRL's KL loss against the frozen base through ``main`` on this backend and on
backend=skyrl (one parametrized test: zero while a tenant's adapter is fresh, positive once it has trained)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.micro_task import assert_learning, micro_tenants, read_records
from skyrl_clora.backends.embedded.backend import EmbeddedBackend
from skyrl_clora.main import main
from skyrl_clora.tenant_loop import Rollout
from skyrl_clora.trainer.batch import TrainBatch


def _args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"trainer.policy.model.path={model_dir}", "preset=demo", f"clora.output_dir={out}", "trainer.max_training_steps=2",
        "clora.progress=false", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=4", "recipe.eval_prompts=0",
        "generator.sampling_params.max_generate_length=8", "generator.max_turns=1", "trainer.max_prompt_length=120",
        "trainer.policy.optimizer_config.lr=1e-2", micro_tenants({}), *extra,
    ]


@pytest.mark.usefixtures("without_production_extras")
@pytest.mark.parametrize("backend", ["embedded", "skyrl"])
@pytest.mark.e2e
def test_kl_loss_is_zero_on_the_fresh_adapter_and_positive_after(backend: str, learning_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(_args(learning_model_dir, out, f"backend={backend}", "trainer.algorithm.use_kl_loss=true",
                      "trainer.algorithm.kl_loss_coef=0.1")) == 0
    records = read_records(out)
    assert_learning(records)
    kl = {r["step"]: r["train/policy_kl"] for r in records if r["event"] == "step"}
    assert kl[1] == pytest.approx(0.0, abs=1e-7) and kl[2] > 1e-7, kl


@pytest.mark.e2e
def test_tinker_style_step_runs_and_learns(learning_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(_args(learning_model_dir, out, "clora.step_style=tinker")) == 0
    assert_learning(read_records(out))


class _Scheduler:
    """Records the batch the embedded backend hands the trainer."""

    def __init__(self) -> None:
        self.batch: TrainBatch | None = None

    async def train(self, tenant: str, batch: TrainBatch) -> tuple[None, dict[str, float]]:
        self.batch = batch
        return None, {}


@pytest.mark.parametrize("step_style", ["skyrl", "tinker"])
def test_the_embedded_backend_passes_the_sampler_log_probs_only_in_the_tinker_step(step_style: str) -> None:
    scheduler = _Scheduler()
    run = SimpleNamespace(trainer=SimpleNamespace(step_style=step_style))
    backend = EmbeddedBackend(run, SimpleNamespace(train_scheduler=lambda run: scheduler))
    sampler = [[-0.25, -1.5], [-2.0]]
    output = {"prompt_token_ids": [[1, 2], [1, 2]], "response_ids": [[3, 4], [5]], "loss_masks": [[1, 1], [1]],
              "rewards": [1.0, 0.0], "rollout_logprobs": sampler}
    asyncio.run(backend.train("t", Rollout(output, ["g", "g"], [], [])))
    assert scheduler.batch.rollout_logprobs == sampler
    assert scheduler.batch.old_logprobs == (sampler if step_style == "tinker" else None)
    if step_style == "tinker":
        with pytest.raises(RuntimeError, match="clora.step_style=tinker needs the sampler's log-probs"):
            asyncio.run(backend.train("t", Rollout({**output, "rollout_logprobs": None}, ["g", "g"], [], [])))
