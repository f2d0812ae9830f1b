"""A run's tenants as Tinker clients: each tenant's RL experiment (the recipe's episodes, SkyRL's advantages, the
tenant loop's evaluations, steps and checkpoints) driven through the ``tinker`` SDK against a Tinker server.

:class:`TinkerClientBackend` is the :class:`~skyrl_clora.tenant_loop.TenantBackend` the tenant loop runs on:

- ``register``: the tenant's first sampling client (version 0), the base model's: a fresh adapter is PEFT's
  (B = 0), which samples as the base model does. Its LoRA training client (its rank and seed) comes at its first
  ``train``, or from its saved state at ``restore``: SkyRL's server, as Tinker's, loads a state only into a model
  that has had no request yet;
- ``sample``: SkyRL's ``SkyRLGymGenerator`` runs the recipe's episodes against :class:`TinkerSampler`, SkyRL's
  ``InferenceEngineInterface`` over the tenant's sampling client (each turn one ``sample`` of one sequence, seeded
  as the embedded sampler seeds it, stopping at the tokenizer's end-of-sequence token);
- ``train``: SkyRL's advantage estimator over the step's episodes, scaled by SkyRL's loss reduction per policy
  mini-batch (:func:`~skyrl_clora.trainer.batch.tenant_advantages`), then per mini-batch one ``forward_backward``
  with Tinker's ``ppo`` loss (the sampler's log-probs are the behaviour policy's, the clip range SkyRL's
  ``eps_clip_low`` / ``eps_clip_high``; summed as Tinker sums, which the reduced advantages make SkyRL's loss) and
  one ``optim_step`` (AdamW: the tenant's LR schedule, betas (0.9, 0.999), eps 1e-8, its weight decay; its
  ``max_grad_norm`` is sent as ``grad_clip_norm``, which a server may drop: SkyRL 0.4's does). SkyRL's
  ``policy_loss_type``, dual clip and KL terms have no Tinker loss here: every client trains with ``ppo``;
- ``publish``: ``save_weights_and_get_sampling_client``; the version counts the publishes;
- ``export`` / ``save``: the weights stay on the server; ``tinker.json`` in the folder names the Tinker paths of
  the saved sampler weights (export) or training state (save); ``restore`` makes the tenant's training client from
  that state with its optimizer (``create_training_client_from_state_with_optimizer``).

:func:`run_recipe_clients` runs a run's tenants this way, concurrently (every client at once) or serially (one
after another), on one server that is already up: the same records and summary fields as the embedded backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tinker
from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)
from skyrl.train.config import SkyRLGymConfig
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from tinker import types
from transformers import AutoTokenizer

from skyrl_clora.backends.embedded.backend import generator_config
from skyrl_clora.checkpoints import TenantCheckpoint, resumed_records
from skyrl_clora.config.checks import algorithm_config
from skyrl_clora.config.schema import RunConfig
from skyrl_clora.metrics import MetricsLog, PoolOutcome
from skyrl_clora.recipes.plugin import TaskSource, load_recipe
from skyrl_clora.sampler.client import prompt_token_ids, request_params
from skyrl_clora.tenant_loop import Rollout, Update, episode_batch, run_tenant_pool, scalar_reward
from skyrl_clora.tenants import TenantSpec
from skyrl_clora.trainer.batch import TrainBatch, mini_batch_rows, tenant_advantages
from skyrl_clora.trainer.lr_schedule import LRSchedule

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # the embedded trainer's AdamW settings
STATE_FILE = "tinker.json"  # the Tinker path a tenant's export or checkpoint folder names


class TinkerSampler(InferenceEngineInterface):
    """SkyRL's ``InferenceEngineInterface`` over one Tinker sampling client (:attr:`client`, replaced at each
    publish with its :attr:`version`). Every prompt is one ``sample`` of one sequence with the request's sampling
    params over ``default_sampling`` (SkyRL's names: ``max_tokens`` or ``max_generate_length``, ``temperature``,
    ``top_p``, ``stop_token_ids``); its seed is :func:`~skyrl_clora.sampler.requests.derive_seed` of (``seed``, the
    session id, the prompt's length), as the embedded sampler's. :meth:`versions_for` tells the versions a
    session's requests were sampled with."""

    def __init__(self, tokenizer: Any, model_name: str, default_sampling: dict[str, Any], seed: int) -> None:
        self.tokenizer, self._model_name, self.default_sampling, self.seed = tokenizer, model_name, default_sampling, seed
        self.client: tinker.SamplingClient | None = None
        self.version = -1
        self._versions: dict[str, list[int]] = {}
        self._requests = 0

    @property
    def model_name(self) -> str:
        return self._model_name

    def versions_for(self, session_id: str) -> list[int]:
        return list(self._versions.get(session_id, []))

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        if self.client is None:
            raise RuntimeError("the tenant's sampling client is not created yet (register it first)")
        prompt_ids = prompt_token_ids(input_batch, self.tokenizer)
        sampling = {**self.default_sampling, **(input_batch.get("sampling_params") or {})}
        sessions = []
        for session in input_batch.get("session_ids") or [None] * len(prompt_ids):
            if session is None:
                self._requests += 1
                session = f"request-{self._requests}"
            sessions.append(str(session))
        client, version = self.client, self.version
        responses = await asyncio.gather(*[
            client.sample(types.ModelInput.from_ints(list(ids)), 1, self._params(sampling, session, len(ids)))
            for ids, session in zip(prompt_ids, sessions)])
        sequences = [response.sequences[0] for response in responses]
        for session in sessions:
            self._versions.setdefault(session, []).append(version)
        return InferenceEngineOutput(
            responses=[self.tokenizer.decode(s.tokens, skip_special_tokens=True) for s in sequences],
            response_ids=[list(s.tokens) for s in sequences],
            stop_reasons=[s.stop_reason for s in sequences],
            response_logprobs=[list(s.logprobs) for s in sequences] if sampling.get("logprobs") is not None else None,
            prompt_logprobs=None, rollout_expert_indices=None, rollout_sample_support=None)

    def _params(self, sampling: dict[str, Any], session: str, prompt_len: int) -> types.SamplingParams:
        """:func:`~skyrl_clora.sampler.client.request_params` as Tinker's sampling params."""
        params = request_params(sampling, self.tokenizer.eos_token_id, self.seed, session, prompt_len)
        return types.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                    stop=list(params.stop_token_ids), seed=params.seed)

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("the Tinker sampler serves token prompts only (SkyRL's generate)")

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("the Tinker sampler serves token prompts only (SkyRL's generate)")

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("the Tinker sampler serves token prompts only (SkyRL's generate)")

    def get_endpoint_url(self) -> str:
        raise NotImplementedError("the Tinker sampler is a client of a Tinker server; use the server's URL")

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """The server keeps its engine awake."""

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """See :meth:`wake_up`."""

    async def update_named_weights(self, request: Any) -> None:
        raise NotImplementedError("Tinker clients publish through save_weights_for_sampler")

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        raise NotImplementedError("Tinker clients publish through save_weights_for_sampler")

    async def teardown(self) -> None:
        """The server outlives its clients."""

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """The server keys its caches by adapter version."""

    async def pause_generation(self) -> None:
        raise NotImplementedError("a Tinker client cannot pause the server's engine")

    async def resume_generation(self) -> None:
        raise NotImplementedError("a Tinker client cannot pause the server's engine")

    async def finish_session(self, session_id: str) -> None:
        """Sessions hold no server state between requests."""

    async def get_world_size(self) -> tuple[int, int]:
        return 1, 1


class TinkerClientBackend:
    """:class:`~skyrl_clora.tenant_loop.TenantBackend` over Tinker clients of one server (module docstring)."""

    def __init__(self, run: RunConfig, service: tinker.ServiceClient, base_model: str, tokenizer: Any) -> None:
        self.run, self.service, self.base_model, self.tokenizer = run, service, base_model, tokenizer
        self.training: dict[str, tinker.TrainingClient] = {}
        self.samplers: dict[str, TinkerSampler] = {}
        self.generators: dict[str, SkyRLGymGenerator] = {}
        self.env_args: dict[str, dict[str, Any]] = {}
        self.specs: dict[str, TenantSpec] = {}
        self.optimizer_steps: dict[str, int] = {}

    async def register(self, spec: TenantSpec) -> None:
        run = self.run
        generator_cfg = generator_config(run, spec)
        sampler = TinkerSampler(self.tokenizer, spec.name, asdict(generator_cfg.sampling_params), spec.seed)
        episode_env = load_recipe(run.recipe.name).episode_env(run.recipe, spec, None)
        self.samplers[spec.name], self.specs[spec.name] = sampler, spec
        self.env_args[spec.name] = episode_env.args
        self.generators[spec.name] = SkyRLGymGenerator(generator_cfg, SkyRLGymConfig(max_env_workers=episode_env.workers),
                                                       sampler, self.tokenizer, policy_model_name=spec.name)
        self.optimizer_steps[spec.name] = 0
        sampler.client, sampler.version = await self.service.create_sampling_client(base_model=self.base_model), 0

    async def _training(self, tenant: str) -> tinker.TrainingClient:
        """The tenant's training client, made (a fresh LoRA of its rank and seed) if it has none yet."""
        if tenant not in self.training:
            spec = self.specs[tenant]
            self.training[tenant] = await self.service.create_lora_training_client(self.base_model, rank=spec.rank,
                                                                                  seed=spec.seed)
        return self.training[tenant]

    async def sample(self, spec: TenantSpec, rows: list[dict[str, Any]], samples: int, tag: str,
                     sampling_params: dict[str, Any] | None = None) -> Rollout:
        generator, sampler = self.generators[spec.name], self.samplers[spec.name]
        batch, trajectory_ids, groups = episode_batch(spec.seed, rows, samples, tag, self.env_args[spec.name],
                                                      sampling_params)
        output = await generator.generate(batch, disable_tqdm=True)
        versions = [sampler.versions_for(t.to_string()) for t in trajectory_ids]
        return Rollout(output, groups, trajectory_ids, versions)

    def version(self, tenant: str) -> int:
        return self.samplers[tenant].version

    def exclusive_update(self, tenant: str) -> AbstractAsyncContextManager:
        """Nothing to hold: the server orders the clients' calls."""
        return contextlib.nullcontext()

    async def train(self, tenant: str, rollout: Rollout) -> Update:
        """Per policy mini-batch a ``forward_backward`` (``ppo``) and an ``optim_step``; metrics the summed loss, the
        gradient norm the server reports and the learning rate, of the last mini-batch."""
        run, spec, training = self.run, self.specs[tenant], await self._training(tenant)
        output = rollout.output
        if output.get("rollout_logprobs") is None:
            raise RuntimeError(f"tenant {tenant}: Tinker's ppo loss needs the sampler's log-probs; the generator "
                               "returned none")
        algorithm = algorithm_config({**run.trainer.algorithm, **spec.algorithm_overrides()})
        batch = TrainBatch(prompt_ids=output["prompt_token_ids"], response_ids=output["response_ids"],
                           loss_masks=output["loss_masks"], rewards=[scalar_reward(r) for r in output["rewards"]],
                           group_ids=rollout.groups, rollout_logprobs=output["rollout_logprobs"])
        minis = mini_batch_rows(rollout.groups, run.trainer.policy_mini_batch_size)
        advantages, _ = tenant_advantages(batch, algorithm, mini_batches=minis,
                                          micro_batch_size=run.trainer.micro_train_batch_size_per_gpu)
        clip = {"clip_low_threshold": 1.0 - algorithm.eps_clip_low, "clip_high_threshold": 1.0 + algorithm.eps_clip_high}
        schedule = LRSchedule(spec.lr, run.trainer.num_warmup_steps, run.steps * run.optimizer_steps_per_rl_step,
                              run.trainer.scheduler)
        metrics: dict[str, float] = {}
        for _ in range(run.trainer.update_epochs_per_batch):
            for rows in minis:
                datums = [ppo_datum(batch, advantages[row].tolist(), row) for row in rows]
                result = training.forward_backward(datums, "ppo", loss_fn_config=clip)
                lr = schedule.lr(self.optimizer_steps[tenant])
                adam = types.AdamParams(learning_rate=lr, beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1], eps=ADAM_EPS,
                                        weight_decay=_or(spec.weight_decay, run.trainer.weight_decay),
                                        grad_clip_norm=_or(spec.max_grad_norm, run.trainer.max_grad_norm))
                step = training.optim_step(adam)
                self.optimizer_steps[tenant] += 1
                metrics = {"loss_sum": float((await result).metrics["loss:sum"]), "lr": lr,
                           **{key: float(value) for key, value in (await step).metrics.items()}}
        return Update(metrics)

    async def publish(self, tenant: str, update: Update) -> int:
        sampler = self.samplers[tenant]
        sampler.client = await (await self._training(tenant)).save_weights_and_get_sampling_client()
        sampler.version += 1
        return sampler.version

    async def export(self, tenant: str, out_dir: Path) -> None:
        saved = await (await self._training(tenant)).save_weights_for_sampler(f"{tenant}-export")
        _write_state(out_dir, {"sampler_weights": saved.path, "version": self.samplers[tenant].version})

    async def save(self, tenant: str, folder: Path) -> None:
        saved = await (await self._training(tenant)).save_state(f"{tenant}-step{self.optimizer_steps[tenant]}")
        _write_state(folder, {"state": saved.path, "optimizer_steps": self.optimizer_steps[tenant]})

    async def restore(self, tenant: str, folder: Path, version: int) -> None:
        state = json.loads((folder / STATE_FILE).read_text())
        if tenant in self.training:
            raise RuntimeError(f"tenant {tenant}: a training client exists already; restore comes right after register")
        training = await self.service.create_training_client_from_state_with_optimizer(state["state"])
        self.training[tenant], self.optimizer_steps[tenant] = training, int(state["optimizer_steps"])
        sampler = self.samplers[tenant]
        sampler.client, sampler.version = await training.save_weights_and_get_sampling_client(), version

    async def end_training(self, tenant: str) -> None:
        """Nothing waits for a client."""

    async def remove(self, tenant: str) -> None:
        """A failed client's model stays on the server until its session ends."""


def ppo_datum(batch: TrainBatch, advantages: list[float], row: int) -> types.Datum:
    """Episode ``row`` of ``batch`` as a Tinker datum: the model reads prompt + response less the last token and
    predicts each next token; the response's trained tokens (loss mask 1) carry their ``advantages`` and the
    sampler's log-probs, every other position zeros (weight 0)."""
    prompt, response, mask = batch.prompt_ids[row], batch.response_ids[row], batch.loss_masks[row]
    tokens = [*prompt, *response]
    before = [0.0] * (len(prompt) - 1)
    trained = [float(m) for m in mask]
    sampled = [lp * m for lp, m in zip(batch.rollout_logprobs[row][:len(response)], trained)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": before + trained, "logprobs": before + sampled,
        "advantages": before + [a * m for a, m in zip(advantages[:len(response)], trained)]})


def run_recipe_clients(run: RunConfig, sources: dict[str, TaskSource], resume: dict[str, TenantCheckpoint],
                       base_url: str, api_key: str, base_model: str) -> PoolOutcome:
    """Runs every unfinished tenant of ``run`` as a Tinker client of the server at ``base_url`` (``api_key``; its
    base model ``base_model``, a folder this process reads the tokenizer from): all at once in concurrent mode, one
    after another in serial mode. Writes metrics.jsonl and checkpoints as the embedded backend does (the weights stay
    on the server); returns the run's records and summary fields (``client_seconds``: each group's wall)."""
    specs = list(run.tenants)
    metrics = MetricsLog.for_run(run, resumed_records(resume, specs))
    unfinished = [spec for spec in specs if not (spec.name in resume and resume[spec.name].finished)]
    groups = ([unfinished] if unfinished else []) if run.mode == "concurrent" else [[spec] for spec in unfinished]
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    walls = []
    try:
        with tinker.ServiceClient(base_url=base_url, api_key=api_key) as service:
            for group in groups:
                started = time.perf_counter()
                backend = TinkerClientBackend(run, service, base_model, tokenizer)
                asyncio.run(run_tenant_pool(run, backend, group, sources, metrics, resume, [], None))
                walls.append(time.perf_counter() - started)
    finally:
        metrics.close()
    fields = {"mode": run.mode, "steps": run.steps, "model_path": base_model, "cold_start_seconds": [],
              "client_seconds": walls, "tinker_server": base_url}
    return PoolOutcome(metrics.records, fields, f"mode={run.mode}")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _write_state(folder: Path, state: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
