"""SkyRL's ``InferenceEngineInterface`` over the embedded engine, so ``SkyRLGymGenerator`` drives it unchanged.

The tenant rides in SkyRL's own ``model=`` argument (the adapter name), as with vLLM's multi-LoRA serving.
Each request's RNG seed is derived from (client seed, session id, prompt length) (``requests.derive_seed``), so a
rollout is reproducible whatever the interleaving of tenants; the adapter name does not enter it (a tenant's
sessions are named after its seed, ``episodes.episode_batch``), so renaming a tenant changes nothing. Every request's adapter version is recorded per
(adapter, session id): :meth:`EmbeddedInferenceClient.versions_for` tells which adapter version(s) a
trajectory was sampled with.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)

from skyrl_clora.lora.peft_export import load_peft_adapter
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.requests import SamplingParams, derive_seed


class EmbeddedInferenceClient(InferenceEngineInterface):
    """``InferenceEngineInterface`` backed by an in-process engine (:class:`EngineThread`)."""

    def __init__(
        self,
        engine: EngineThread,
        tokenizer: Any,
        model_name: str,
        default_sampling: dict[str, Any],
        seed: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._model_name = model_name
        self.default_sampling = default_sampling
        self.seed = seed
        self._versions: dict[tuple[str | None, str], list[int]] = defaultdict(list)
        self._request_counter = 0

    @property
    def model_name(self) -> str:
        return self._model_name

    def versions_for(self, adapter: str | None, session_id: str) -> list[int]:
        """Adapter versions of every request made so far for ``session_id`` of ``adapter`` (one per turn)."""
        return list(self._versions.get((adapter, session_id), []))

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> InferenceEngineOutput:
        adapter = None if model in (None, self._model_name) else model
        prompt_ids = prompt_token_ids(input_batch, self.tokenizer)
        session_ids = input_batch.get("session_ids") or [None] * len(prompt_ids)
        sampling = {**self.default_sampling, **(input_batch.get("sampling_params") or {})}
        futures = []
        for ids, session in zip(prompt_ids, session_ids):
            if session is None:
                self._request_counter += 1
                session = f"request-{self._request_counter}"
            params = request_params(sampling, self.tokenizer.eos_token_id, self.seed, str(session), len(ids))
            futures.append((str(session), asyncio.wrap_future(self.engine.submit(ids, adapter, params))))
        completions = []
        for session, future in futures:
            completion = await future
            self._versions[(adapter, session)].append(completion.adapter_version)
            completions.append(completion)
        want_logprobs = sampling.get("logprobs") is not None
        return InferenceEngineOutput(
            responses=[self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions],
            response_ids=[c.token_ids for c in completions],
            stop_reasons=[c.finish_reason for c in completions],
            response_logprobs=[c.logprobs for c in completions] if want_logprobs else None,
            prompt_logprobs=None,
            rollout_expert_indices=None,
            rollout_sample_support=None,
        )

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        """OpenAI-style chat completion: ``{"json": {"messages": [...], "model": ..., "max_tokens": ...}}``."""
        body = request_payload["json"]
        output = await self.generate(
            InferenceEngineInput(prompts=[body["messages"]], session_ids=[body.get("user")], sampling_params=_openai_sampling(body)),
            model=body.get("model"),
        )
        return {
            "object": "chat.completion",
            "model": body.get("model", self._model_name),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": output["responses"][0]},
                    "finish_reason": output["stop_reasons"][0],
                }
            ],
        }

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        """OpenAI-style text completion: ``{"json": {"prompt": str, "model": ..., "max_tokens": ...}}``."""
        body = request_payload["json"]
        ids = self.tokenizer.encode(body["prompt"], add_special_tokens=False)
        output = await self.generate(
            InferenceEngineInput(prompt_token_ids=[ids], sampling_params=_openai_sampling(body)), model=body.get("model")
        )
        return {
            "object": "text_completion",
            "model": body.get("model", self._model_name),
            "choices": [{"index": 0, "text": output["responses"][0], "finish_reason": output["stop_reasons"][0]}],
        }

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        body = request_payload["json"]
        ids = self.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return {"prompt_token_ids": ids, "prompt": self.tokenizer.decode(ids)}

    def get_endpoint_url(self) -> str:
        raise NotImplementedError("the embedded engine is in-process; serve it over HTTP to get an endpoint URL")

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """The embedded engine never releases its memory, so there is nothing to wake."""

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """See :meth:`wake_up`: the base model stays resident for every tenant."""

    async def update_named_weights(self, request: Any) -> None:
        raise NotImplementedError("the embedded engine's base model is frozen; publish adapters instead")

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Loads a PEFT adapter folder into ``lora_name``'s slot in place (registering it if new)."""
        from pathlib import Path

        weights = load_peft_adapter(Path(lora_path))
        try:
            version = self.engine.adapter_version(lora_name) + 1
        except KeyError:
            await asyncio.to_thread(self.engine.register_adapter, lora_name, weights, 0)
            return {"lora_name": lora_name, "version": 0}
        await asyncio.wrap_future(self.engine.publish(lora_name, weights, version))
        return {"lora_name": lora_name, "version": version}

    async def teardown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Does nothing, as no reset is needed: the engine's prefix cache (``BlockManager``'s keyed prompt blocks and
        finished-turn histories) is keyed by (adapter, published version), and each publish or load of an adapter
        drops that adapter's entries, so no entry serves a request other weights than its own. Running requests
        finish with the version they were admitted under (``reset_running_requests`` changes nothing)."""

    async def pause_generation(self) -> None:
        self.engine.pause()

    async def resume_generation(self) -> None:
        self.engine.resume()

    async def finish_session(self, session_id: str) -> None:
        """Sessions hold no engine state between requests."""

    async def get_world_size(self) -> tuple[int, int]:
        return 1, 1


def prompt_token_ids(input_batch: InferenceEngineInput, tokenizer: Any) -> list[list[int]]:
    """The batch's ``prompt_token_ids``, else its ``prompts`` (chat messages) through the tokenizer's chat template
    with the generation prompt."""
    prompt_ids = input_batch.get("prompt_token_ids")
    if prompt_ids is not None:
        return prompt_ids
    return [tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
            for conversation in input_batch["prompts"]]


def request_params(sampling: dict[str, Any], eos_token_id: int | None, seed: int, session: str,
                   prompt_len: int) -> SamplingParams:
    """One request's sampling settings from ``sampling`` (SkyRL's keys: ``max_tokens`` or ``max_generate_length``,
    ``temperature``, ``top_p``, ``stop_token_ids``): it stops at ``eos_token_id`` and the stop tokens, and its RNG seed
    is :func:`derive_seed` of (``seed``, ``session``, ``prompt_len``). A ValueError when no token limit is given."""
    max_tokens = sampling.get("max_tokens", sampling.get("max_generate_length"))
    if max_tokens is None:
        raise ValueError("sampling params need max_tokens (or max_generate_length)")
    stop_ids = [eos_token_id, *(sampling.get("stop_token_ids") or [])]
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        stop_token_ids=tuple(int(t) for t in stop_ids if t is not None),
        seed=derive_seed(seed, session, prompt_len),
    )


def _openai_sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in ("max_tokens", "temperature", "top_p") if key in body}
