"""``CloraTinkerBackend``: SkyRL's Tinker server (``skyrl.tinker``) on the embedded engine and trainer.

One base model serves every Tinker client: :func:`~skyrl_clora.backends.embedded.services.build_services` builds the
embedded backend's engine (every model's samples decode in one batch, each row with its model's adapter) and trainer
(each model a tenant of the AdapterStore: :class:`~skyrl_clora.tinker.training.TinkerTrainer`), sized by
:class:`CloraTinkerConfig`. SkyRL's engine calls, on its one thread:

=================================  ====================================================================================
``create_model(id, lora_config)``  a tenant at the client's rank (alpha: the server's), PEFT's initial adapter from its
                                   seed; the engine serves it as version 0
``forward_backward`` / ``forward``  per model: the datums' target log-probs and elementwise losses
                                   (:mod:`~skyrl_clora.tinker.losses`); forward_backward adds the summed loss's gradient
                                   to the model's, until its ``optim_step``; metric ``loss:sum``
``optim_step(id, adam_params)``    one AdamW step with the call's settings; metrics the gradient norm and the LR
``save_sampler_checkpoint``        publishes the model's adapter into the engine in place as its next version (other
                                   models keep decoding); the checkpoint id names that version. ``persist``: the PEFT
                                   folder as a ``.tar.gz`` at the path, else a marker archive naming the version
``sample``                         every request of every model in one engine batch, each sequence ending at the
                                   tokenizer's end-of-sequence token or a stop token; each sequence must come from the
                                   version its checkpoint id names (an older checkpoint of a model answers an error:
                                   the engine holds each model's latest sampler weights); model "" is the base model.
                                   Prompt log-probs: the trainer's forward under that version's adapter
``save_checkpoint``,               the model's training state (masters, Adam moments, gradients, step) as a
``load_checkpoint``                ``.tar.gz``; load restores it into an existing model of the same rank
``delete_model``                   the tenant and its engine slot are freed
=================================  ====================================================================================

Not supported, each answered with an error naming it: top-k prompt log-probs, stop strings (stop tokens are),
``top_k``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from skyrl.backends.backend import AbstractBackend
from skyrl.backends.renderer import render_model_input
from skyrl.tinker import types

from skyrl_clora.backends.embedded.services import Services, build_services
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.config.schema import RunConfig
from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.lora.peft_export import save_peft_adapter
from skyrl_clora.sampler.requests import SamplingParams
from skyrl_clora.tinker.training import Datum, TinkerTrainer

MARKER = "clora_sampler.json"  # the archive member of a sampler checkpoint that is not persisted


class CloraTinkerConfig(BaseModel, extra="forbid"):
    """The server's ``--backend-config`` for backend ``clora``."""

    max_lora_adapters: int = Field(8, ge=1, description="Tinker models served at once (engine adapter slots)")
    max_lora_rank: int = Field(32, ge=1, description="the largest LoRA rank a client may ask for")
    max_rows: int = Field(64, ge=1, description="sequences the engine decodes at once")
    max_sequence_length: int = Field(2048, ge=16, description="prompt plus sampled tokens of one sequence")
    micro_batch_tokens: int = Field(8192, ge=1, description="padded positions of one training forward")
    overrides: list[str] = Field(default_factory=list,
                                 description="skyrl_clora config overrides, e.g. clora.device=cpu")


def tinker_run_config(base_model: str, config: CloraTinkerConfig) -> RunConfig:
    """The run configuration the services are built from: the base model, the engine's rows, slots, sequence length
    and LoRA rank from ``config`` (the run's own tenants, which Tinker never uses, at that rank), then
    ``config.overrides``."""
    generate = config.max_sequence_length // 2
    return build_run_config(compose_config([
        f"trainer.policy.model.path={base_model}", f"clora.max_tenants={config.max_lora_adapters}",
        f"sampler.max_lora_rank={config.max_lora_rank}", f"trainer.policy.model.lora.rank={config.max_lora_rank}",
        f"sampler.max_rows={config.max_rows}",
        f"generator.max_input_length={config.max_sequence_length - generate}",
        f"generator.sampling_params.max_generate_length={generate}", *config.overrides]))


class CloraTinkerBackend(AbstractBackend):
    """SkyRL's ``AbstractBackend`` over the embedded engine and trainer (module docstring)."""

    samples_beside_blocking_ops = True
    """SkyRL's continuous sampler need not drain the running samples before a training call, a publish or a model's
    creation or deletion (:mod:`skyrl_clora.tinker.engine_main` reads this): the engine decodes beside the trainer
    (whose calls hold its lock), a publish or unregister lands once its model has no running sequence, and
    :meth:`delete_model` waits for the model's own sequences."""

    def __init__(self, base_model: str, config: CloraTinkerConfig) -> None:
        self.base_model, self.config = base_model, config
        self.run = tinker_run_config(base_model, config)
        rows_per_model = -(-config.max_rows // config.max_lora_adapters)
        self.services: Services = build_services(self.run, base_model, config.max_lora_adapters, rows_per_model)
        self.training = TinkerTrainer(self.services.trainer, config.micro_batch_tokens)
        self.metrics = types.EngineMetrics()
        self.models: dict[str, types.LoraConfig] = {}
        self.sampler_checkpoints: dict[str, dict[str, int]] = {}  # model -> checkpoint id -> engine version
        self.published: dict[str, AdapterWeights] = {}  # model -> the adapter its latest version holds
        self.running: dict[str, set[concurrent.futures.Future]] = {}  # model -> its sequences the engine decodes

    # ---- models -------------------------------------------------------------------------------------
    def create_model(self, model_id: str, lora_config: types.LoraConfig, model_role: str = "policy") -> None:
        if model_role != "policy":
            raise ValueError(f"model_role {model_role!r} is not supported by the clora backend (policy only)")
        if model_id in self.models:
            raise ValueError(f"model {model_id!r} already exists")
        if len(self.models) >= self.config.max_lora_adapters:
            raise ValueError(f"the server holds {len(self.models)} models, its max_lora_adapters; delete one or "
                             "start the server with a larger --backend-config max_lora_adapters")
        if not 1 <= lora_config.rank <= self.config.max_lora_rank:
            raise ValueError(f"LoRA rank {lora_config.rank} is outside 1..{self.config.max_lora_rank} (the server's "
                             "max_lora_rank)")
        weights = self.training.create(model_id, lora_config.rank, lora_config.alpha, lora_config.seed)
        self.services.engine.register_adapter(model_id, weights, version=0)
        self.published[model_id] = weights
        self.models[model_id] = lora_config
        self.sampler_checkpoints[model_id] = {}

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models

    def delete_model(self, model_id: str) -> None:
        """Frees the model once the engine has finished its running sequences."""
        self._require_model(model_id)
        concurrent.futures.wait(list(self.running.pop(model_id, ())))
        self.training.delete(model_id)
        self.services.engine.unregister_adapter(model_id).result()
        del self.models[model_id], self.sampler_checkpoints[model_id], self.published[model_id]

    # ---- training -----------------------------------------------------------------------------------
    def forward_backward(self, prepared_batch: types.PreparedModelPassBatch) -> dict[str, Any]:
        return self._passes(prepared_batch, backward=True)

    def forward(self, prepared_batch: types.PreparedModelPassBatch) -> dict[str, Any]:
        return self._passes(prepared_batch, backward=False)

    def _passes(self, batch: types.PreparedModelPassBatch, backward: bool) -> dict[str, Any]:
        """Each request's output, or its error (a bad request fails alone)."""
        tokens = [rendered.prompt_ids for rendered in render_model_input(batch.all_model_inputs)]
        results: dict[str, Any] = {}
        for request_id, model_id, start, end in batch.request_batch_slices:
            try:
                self._require_model(model_id)
                loss_fns = set(batch.all_loss_fns[start:end])
                if len(loss_fns) != 1:
                    raise ValueError(f"one request mixes loss functions {sorted(loss_fns)}")
                datums = [Datum(tokens[i], list(batch.all_targets[i]), list(batch.all_token_weights[i]),
                                list(batch.all_sampling_logprobs[i]) or None, list(batch.all_advantages[i]) or None)
                          for i in range(start, end)]
                done = self.training.pass_datums(model_id, datums, loss_fns.pop(), batch.all_loss_fn_configs[start],
                                                 backward)
            except ValueError as error:
                results[request_id] = types.ErrorResponse(error=str(error), status="failed")
                continue
            outputs = [{"logprobs": _tensor_json(result.logprobs), "elementwise_loss": _tensor_json(result.loss)}
                       for result in done]
            total = float(sum(result.loss.sum() for result in done))
            results[request_id] = types.ForwardBackwardOutput(loss_fn_output_type="scalar", loss_fn_outputs=outputs,
                                                              metrics={"loss:sum": total})
        return results

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        self._require_model(model_id)
        adam = request_data.adam_params
        norm = self.training.optim_step(model_id, adam.learning_rate, (adam.beta1, adam.beta2), adam.eps,
                                        adam.weight_decay)
        return types.OptimStepOutput(metrics={"skyrl.ai/grad_norm": norm, "skyrl.ai/learning_rate": adam.learning_rate})

    # ---- sampling -----------------------------------------------------------------------------------
    def save_sampler_checkpoint(self, output_path: Any, model_id: str, persist: bool = True) -> None:
        self._require_model(model_id)
        weights = self.training.host_weights(model_id)
        engine = self.services.engine
        version = engine.adapter_version(model_id) + 1
        engine.publish(model_id, weights, version).result()
        self.sampler_checkpoints[model_id][_checkpoint_id(output_path)] = version
        self.published[model_id] = weights
        if persist:
            with tempfile.TemporaryDirectory() as folder:
                save_peft_adapter(weights, Path(folder), self.base_model)
                _write_archive(output_path, {p.name: p.read_bytes() for p in Path(folder).iterdir()})
        else:
            marker = {"model_id": model_id, "version": version}
            _write_archive(output_path, {MARKER: json.dumps(marker).encode()})

    def sample(self, prepared_batch: types.PreparedSampleBatch) -> dict[str, Any]:
        """Every request's sequences, all submitted to the engine before any is awaited (one decode batch); with
        ``prompt_logprobs``, its prompt's log-probs under the weights its sequences come from (the trainer scores them
        while the engine decodes). SkyRL's serial engine loop calls this; its continuous sampler calls
        :meth:`sample_batch_async`."""
        submitted, results = self._submit_requests(prepared_batch)
        for request_id, (futures, prompt) in submitted.items():
            try:
                scored = self._scored(prompt) if prompt is not None else None
                done = [(future.result(), version) for future, version in futures]
            except (ValueError, RuntimeError) as error:
                results[request_id] = types.ErrorResponse(error=str(error), status="failed")
                continue
            results[request_id] = _output(done, scored)
        return results

    async def sample_batch_async(self, prepared_batch: types.PreparedSampleBatch) -> dict[str, Any]:
        """:meth:`sample` for SkyRL's continuous sampler: each request's result once its own sequences are done (the
        engine keeps decoding every other request meanwhile)."""
        submitted, results = self._submit_requests(prepared_batch)
        for request_id, (futures, prompt) in submitted.items():
            try:
                scored = await asyncio.to_thread(self._scored, prompt) if prompt is not None else None
                done = [(await asyncio.wrap_future(future), version) for future, version in futures]
            except (ValueError, RuntimeError) as error:
                results[request_id] = types.ErrorResponse(error=str(error), status="failed")
                continue
            results[request_id] = _output(done, scored)
        return results

    def prepare_for_sampling(self) -> None:
        """Nothing to prepare: the engine is always up (SkyRL's continuous sampler calls this before admitting)."""

    def _submit_requests(self, batch: types.PreparedSampleBatch) -> tuple[dict[str, Any], dict[str, Any]]:
        """Queues every sequence of every request: per request id its ``(future, version)`` pairs and, when it asks
        for prompt log-probs, ``(model id, prompt)`` (else None); and the error of each request that failed."""
        prompts = [rendered.prompt_ids for rendered in render_model_input(batch.all_model_inputs)]
        submitted: dict[str, Any] = {}
        errors: dict[str, Any] = {}
        for request_id, model_id, start, end, prompt_logprobs, topk in batch.request_batch_slices:
            try:
                if topk:
                    raise ValueError("top-k prompt log-probs are not supported by the clora backend")
                futures = [self._submit(model_id, batch.all_checkpoint_ids[i], prompts[i], batch.all_sampling_params[i])
                           for i in range(start, end)]
                submitted[request_id] = (futures, (model_id, prompts[start]) if prompt_logprobs else None)
            except ValueError as error:
                errors[request_id] = types.ErrorResponse(error=str(error), status="failed")
        return submitted, errors

    def _scored(self, request: tuple[str, list[int]]) -> list[float | None]:
        """Tinker's prompt log-probs of ``request`` (model id, prompt) under the model's published adapter (model "":
        the base model): None for the first token."""
        model_id, prompt = request
        weights = self.published[model_id] if model_id else None
        return [None, *self.training.prompt_logprobs(weights, [prompt])[0]]

    def _submit(self, model_id: str, checkpoint_id: str, prompt: list[int],
                params: types.SamplingParams) -> tuple[concurrent.futures.Future, int | None]:
        """Queues one sequence; returns its future and the adapter version it must be sampled with (None: base)."""
        if params.stop_strings:
            raise ValueError("stop strings are not supported by the clora backend; pass stop token ids")
        if params.top_k not in (-1, 0):
            raise ValueError(f"top_k={params.top_k} is not supported by the clora backend")
        version = None
        if model_id:
            self._require_model(model_id)
            version = self.sampler_checkpoints[model_id].get(checkpoint_id)
            if version is None:
                raise ValueError(f"model {model_id!r} has no sampler checkpoint {checkpoint_id!r}")
            if version != self.services.engine.adapter_version(model_id):
                raise ValueError(f"sampler checkpoint {checkpoint_id!r} of {model_id!r} was replaced by a later "
                                 "save_weights_for_sampler; the clora backend serves each model's latest weights")
        stop = (self.services.tokenizer.eos_token_id, *(params.stop_tokens or ()))  # EOS always stops, as vLLM's
        engine_params = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                       stop_token_ids=tuple(int(t) for t in stop if t is not None), seed=params.seed)
        future = self.services.engine.submit(prompt, model_id or None, engine_params)
        if model_id:
            running = self.running.setdefault(model_id, set())
            running.add(future)
            future.add_done_callback(running.discard)
        return future, version

    # ---- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, output_path: Any, model_id: str) -> None:
        self._require_model(model_id)
        with tempfile.TemporaryDirectory() as folder:
            self.training.save_state(model_id, Path(folder))
            _write_archive(output_path, {p.name: p.read_bytes() for p in Path(folder).iterdir()})

    def load_checkpoint(self, checkpoint_path: Any, model_id: str, load_optimizer: bool) -> None:
        self._require_model(model_id)
        with tempfile.TemporaryDirectory() as folder:
            with tarfile.open(str(checkpoint_path), "r:gz") as archive:
                archive.extractall(folder, filter="data")
            self.training.load_state(model_id, Path(folder), with_optimizer=load_optimizer)

    # ---- helpers ------------------------------------------------------------------------------------
    def _require_model(self, model_id: str) -> None:
        if model_id not in self.models:
            raise ValueError(f"model {model_id!r} does not exist on this server")

    def shutdown(self) -> None:
        self.services.shutdown()


def _checkpoint_id(output_path: Any) -> str:
    """The checkpoint id of a sampler checkpoint's archive path (``.../sampler_weights/<id>.tar.gz``)."""
    return Path(str(output_path)).name.removesuffix(".tar.gz")


def _write_archive(output_path: Any, members: dict[str, bytes]) -> None:
    """A ``.tar.gz`` of ``members`` (name -> bytes) at ``output_path``, its folder made first."""
    path = Path(str(output_path))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _output(done: list[tuple[Any, int | None]], scored: list[float | None] | None) -> types.SampleOutput | types.ErrorResponse:
    """A request's answer from its ``(completion, version)`` pairs and prompt log-probs: its sequences, or the error
    of the first sequence that did not come from its version."""
    try:
        sequences = [_sequence(completion, version) for completion, version in done]
    except RuntimeError as error:
        return types.ErrorResponse(error=str(error), status="failed")
    return types.SampleOutput(sequences=sequences, prompt_logprobs=scored)


def _sequence(completion: Any, version: int | None) -> types.GeneratedSequence:
    """A completion as Tinker's sequence, after checking it came from ``version`` (the base model: -1)."""
    expected = -1 if version is None else version
    if completion.adapter_version != expected:
        raise RuntimeError(f"a sequence was sampled with adapter version {completion.adapter_version}, its sampling "
                           f"client's checkpoint is version {expected}")
    stop = "stop" if completion.finish_reason == "stop" else "length"
    return types.GeneratedSequence(stop_reason=stop, tokens=list(completion.token_ids),
                                   logprobs=[float(x) for x in completion.logprobs])


def _tensor_json(values: Any) -> dict[str, Any]:
    """A 1-D tensor as Tinker's tensor data (``data``, ``dtype``, ``shape``)."""
    return {"data": values.tolist(), "dtype": "float32", "shape": [int(values.numel())]}
