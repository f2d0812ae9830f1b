"""Helpers shared by the tests (imported as ``tests.support.helpers``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch

from skyrl_clora.lora.layers import AdapterWeights, MultiLoRALinear
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora


def random_adapter(layers: dict[str, MultiLoRALinear], seed: int, rank: int = 8, alpha: float = 16.0,
                   b_std: float = 0.3) -> AdapterWeights:
    """PEFT-initialised A with a random (non-zero) B, so the adapter visibly changes the model's output."""
    generator = torch.Generator().manual_seed(seed)
    adapter = init_adapter(layers, rank, alpha, generator)
    for path in adapter.b:
        adapter.b[path] = torch.randn(adapter.b[path].shape, generator=generator) * b_std
    return adapter


# Fused element-wise ops: Triton computes in fp32 and rounds once; the references round after each op as
# Hugging Face does (and the CPU interpreter truncates when it rounds to bf16).
def start_engine(model: torch.nn.Module, config: EngineConfig, adapters: dict[str, int], max_rank: int = 8,
                 b_std: float = 0.3) -> tuple[EngineThread, dict[str, AdapterWeights]]:
    """An engine thread on ``model`` (4 inference LoRA slots of ``max_rank``) with a :func:`random_adapter` (rank 8,
    B's scale ``b_std``) registered per ``adapters`` entry (name -> seed); returns the thread and the adapters by name."""
    _, layers = attach_engine_lora(model, num_slots=4, max_rank=max_rank)
    engine = EngineThread(Engine(model, layers, config))
    weights = {name: random_adapter(layers, seed, b_std=b_std) for name, seed in adapters.items()}
    for name, adapter in weights.items():
        engine.register_adapter(name, adapter)
    return engine, weights


FUSED_OP_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_fused_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` matches ``want`` within :data:`FUSED_OP_TOLERANCE` of ``dtype``, relative to ``want``'s largest entry."""
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))
    assert err < FUSED_OP_TOLERANCE[dtype], f"relative error {err:.2e}"


def record_built(monkeypatch, module, name: str) -> list:
    """Patches factory ``module.name`` to append everything it builds to the returned list (e.g. the services
    or stack a run of ``main`` builds, for a test to inspect or act on)."""
    built: list = []
    factory = getattr(module, name)

    def recording(*args, **kwargs):
        built.append(factory(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(module, name, recording)
    return built


def http_call(url: str, method: str, body: Any = None, authorization: str | None = None) -> tuple[int, Any]:
    """``method url`` with ``body`` as JSON and ``authorization`` as the Authorization header (none if None):
    (HTTP status, the answer's JSON, or its text if it is not JSON)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    call = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(call, timeout=120) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def differing_keys(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ bit for bit (or exist on one side only), sorted."""
    return sorted(key for key in left.keys() | right.keys()
                  if key not in left or key not in right or not torch.equal(left[key], right[key]))
