"""A test double of a Tinker backend for the server's plumbing tests (``--backend
tests.tinker.plumbing_backend:plumbing_backend``): no model behind it, only what makes the server's routes observable.

- Each model counts its ``optim_step`` calls; ``optim_step`` answers the count as metric ``steps``.
- ``save_checkpoint`` writes the count into the checkpoint (a tar with one ``steps`` file); ``load_checkpoint`` reads
  it back into the loading model, so a model created from a checkpoint reports the source's count.
- ``forward_backward`` / ``forward``: log-prob -1 for every target token, the loss the weighted sum.
- ``sample``: each sequence is ``max_tokens`` tokens counting up from its sampling seed (mod ``vocab_size``; SkyRL
  gives sample ``j`` of a request the request's seed + ``j``), log-prob -0.5 each; prompt log-probs
  ``[None, -1, -1, ...]`` when asked; top-k prompt log-probs when asked: the first position ``None``, every other
  ``k`` pairs ``(rank, -(rank + 1))``.
"""

from __future__ import annotations

import io
import tarfile

from pydantic import BaseModel
from skyrl.backends.backend import AbstractBackend
from skyrl.backends.renderer import render_model_input
from skyrl.tinker import types


class PlumbingConfig(BaseModel, extra="forbid"):
    vocab_size: int = 1000


class PlumbingBackend(AbstractBackend):
    def __init__(self, base_model: str, config: PlumbingConfig) -> None:
        self.config = config
        self.steps: dict[str, int] = {}
        self.metrics = types.EngineMetrics()

    def create_model(self, model_id: str, lora_config: types.LoraConfig, model_role: str = "policy") -> None:
        self.steps[model_id] = 0

    def has_model(self, model_id: str) -> bool:
        return model_id in self.steps

    def delete_model(self, model_id: str) -> None:
        del self.steps[model_id]

    def forward_backward(self, batch: types.PreparedModelPassBatch) -> dict[str, types.ForwardBackwardOutput]:
        outputs = {}
        for request_id, _, start, end in batch.request_batch_slices:
            datums, loss = [], 0.0
            for i in range(start, end):
                n = len(batch.all_targets[i])
                elementwise = list(batch.all_token_weights[i])  # -log-prob * weight
                loss += sum(elementwise)
                datums.append({"logprobs": {"data": [-1.0] * n, "dtype": "float32", "shape": [n]},
                               "elementwise_loss": {"data": elementwise, "dtype": "float32", "shape": [n]}})
            outputs[request_id] = types.ForwardBackwardOutput(loss_fn_output_type="scalar", loss_fn_outputs=datums,
                                                              metrics={"loss:sum": loss})
        return outputs

    def forward(self, batch: types.PreparedModelPassBatch) -> dict[str, types.ForwardBackwardOutput]:
        return self.forward_backward(batch)

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        self.steps[model_id] += 1
        return types.OptimStepOutput(metrics={"steps": float(self.steps[model_id])})

    def sample(self, batch: types.PreparedSampleBatch) -> dict[str, types.SampleOutput]:
        prompts = render_model_input(batch.all_model_inputs)
        outputs = {}
        for request_id, _, start, end, prompt_logprobs, topk in batch.request_batch_slices:
            sequences = []
            for i in range(start, end):
                params = batch.all_sampling_params[i]
                tokens = [(params.seed + j) % self.config.vocab_size for j in range(params.max_tokens)]
                sequences.append(types.GeneratedSequence(stop_reason="length", tokens=tokens,
                                                         logprobs=[-0.5] * len(tokens)))
            length = len(prompts[start].prompt_ids)
            outputs[request_id] = types.SampleOutput(
                sequences=sequences,
                prompt_logprobs=[None] + [-1.0] * (length - 1) if prompt_logprobs else None,
                topk_prompt_logprobs=([None] + [[(rank, -(rank + 1.0)) for rank in range(topk)]
                                                for _ in range(length - 1)]) if topk else None)
        return outputs

    def save_checkpoint(self, output_path, model_id: str) -> None:  # noqa: ANN001 - SkyRL's AnyPath
        _write_tar(output_path, str(self.steps[model_id]))

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool) -> None:  # noqa: ANN001
        with tarfile.open(str(checkpoint_path)) as archive:
            self.steps[model_id] = int(archive.extractfile("steps").read())

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:  # noqa: ANN001
        _write_tar(output_path, str(self.steps[model_id]))


def _write_tar(path, text: str) -> None:  # noqa: ANN001 - SkyRL's AnyPath
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode()
    with tarfile.open(str(path), "w") as archive:
        info = tarfile.TarInfo("steps")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))


def plumbing_backend() -> tuple[type[PlumbingBackend], type[PlumbingConfig]]:
    return PlumbingBackend, PlumbingConfig
