"""The sampler's log-probs are the trainer's: tokens the embedded engine draws on the GPU (bf16, CUDA graphs, a
mixed-tenant batch with a temperature per tenant) carry the log-probs the trainer computes for the same tokens
under the same adapter at the same temperature (SkyRL's ``logits / T`` policy forward), to bf16 tolerance.
On the CPU too (the torch reference paths); the CUDA case is skipped without a GPU.

The two compute the same function along different kernels (the engine: folded LoRA GEMMs, paged flash-decoding,
one row per step; the trainer: HF's forward over whole sequences with the multi-LoRA layers), so they agree to bf16
rounding of the hidden states, not bit for bit. The test first checks that what it compares can tell the cases
apart: another temperature, or another tenant's adapter, moves the log-probs far past that tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from skyrl.train.config import AlgorithmConfig
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.support.helpers import random_adapter
from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import SamplingParams
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]

# tenant -> (adapter seed, temperature, top_p): greedy, plain, cooler, hotter with a nucleus
TENANTS = {"a": (1, 0.0, 1.0), "b": (2, 1.0, 1.0), "c": (3, 0.6, 1.0), "d": (4, 1.3, 0.9)}
REQUESTS_PER_TENANT = 4
MAX_TOKENS = 24
# bf16 keeps 8 bits of mantissa: the two paths' logits differ by a few bf16 roundings of values of order 1-10,
# i.e. a few hundredths of a nat per token; a wrong temperature or adapter moves log-probs by tenths or more.
MEAN_GAP, MAX_GAP = 0.03, 0.25


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # wider than HF's init, so log-probs spread well past bf16 rounding
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    out = tmp_path_factory.mktemp("logprob-model")
    model.save_pretrained(out)
    return out


def _load(model_dir: Path, device: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)


def _trainer(model_dir: Path, device: str) -> Trainer:
    model = _load(model_dir, device)
    routing, layers = attach_multi_lora(model, num_slots=1, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=1)
    for name, (seed, temperature, _) in TENANTS.items():
        store.register(name, random_adapter(layers, seed, b_std=0.05), LRSchedule(base_lr=1e-3), seed=seed)
        store.tenants[name].algorithm = AlgorithmConfig(use_kl_loss=False, temperature=temperature)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False), OptimizerConfig(),
                   micro_batch_size=8))


def _sample(model_dir: Path, device: str) -> dict[str, list[tuple[list[int], list[int], list[float]]]]:
    """Every tenant's requests submitted at once (one mixed decode batch): per tenant, (prompt, tokens, log-probs)."""
    model = _load(model_dir, device).eval()
    _, layers = attach_engine_lora(model, num_slots=len(TENANTS), max_rank=16)
    engine = EngineThread(Engine(model, layers, EngineConfig(num_rows=32, max_len=128, block_size=32,
                                                             cuda_graphs=device == "cuda")))
    try:
        for name, (seed, *_) in TENANTS.items():
            engine.register_adapter(name, random_adapter(layers, seed, b_std=0.05))
        generator = torch.Generator().manual_seed(0)
        jobs = []
        for index in range(REQUESTS_PER_TENANT):
            for name, (_, temperature, top_p) in TENANTS.items():
                prompt = torch.randint(3, 512, (int(torch.randint(8, 40, (1,), generator=generator)),),
                                       generator=generator).tolist()
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, top_p=top_p, seed=100 + index)
                jobs.append((name, prompt, engine.submit(prompt, name, params)))
        drawn: dict[str, list] = {name: [] for name in TENANTS}
        for name, prompt, future in jobs:
            completion = future.result(timeout=300)
            drawn[name].append((prompt, completion.token_ids, completion.logprobs))
        return drawn
    finally:
        engine.shutdown()


def _batch(rows: list[tuple[list[int], list[int], list[float]]]) -> TrainBatch:
    return TrainBatch(prompt_ids=[p for p, _, _ in rows], response_ids=[t for _, t, _ in rows],
                      loss_masks=[[1] * len(t) for _, t, _ in rows], rewards=[0.0] * len(rows),
                      group_ids=[f"g{i}" for i in range(len(rows))], rollout_logprobs=None)


def _flat(logprobs: torch.Tensor, rows: list[tuple[list[int], list[int], list[float]]]) -> torch.Tensor:
    return torch.cat([logprobs[i, : len(tokens)].double().cpu() for i, (_, tokens, _) in enumerate(rows)])


@pytest.mark.parametrize("device", DEVICES)
def test_engine_logprobs_are_the_trainers_under_each_tenants_adapter_and_temperature(model_dir: Path, device: str) -> None:
    drawn = _sample(model_dir, device)
    outputs = {name: tuple(tuple(tokens) for _, tokens, _ in rows) for name, rows in drawn.items()}
    assert len(set(outputs.values())) == len(TENANTS), "tenants' outputs must differ"
    trainer = _trainer(model_dir, device)
    others = list(TENANTS)[1:] + list(TENANTS)[:1]
    for (name, rows), other in zip(drawn.items(), others):
        batch = _batch(rows)
        reported = torch.cat([torch.tensor(lp, dtype=torch.float64) for _, _, lp in rows])
        trained = _flat(trainer.response_logprobs(name, batch), rows)
        gap = (reported - trained).abs()
        print(f"{name}: T={TENANTS[name][1]} mean gap {float(gap.mean()):.4f} max {float(gap.max()):.4f} "
              f"over {gap.numel()} tokens")
        temperature = TENANTS[name][1]
        if temperature not in (0.0, 1.0):  # the test can tell a wrong temperature
            untempered = _flat(trainer.response_logprobs(name, batch, temperature=1.0), rows)
            assert float((reported - untempered).abs().mean()) > 4 * MEAN_GAP, name
        # ... and a wrong adapter
        foreign = _flat(trainer.response_logprobs(other, batch, temperature=temperature or 1.0), rows)
        assert float((reported - foreign).abs().mean()) > 4 * MEAN_GAP, name
        assert float(gap.mean()) < MEAN_GAP and float(gap.max()) < MAX_GAP, name
