"""The trainer on the GPU: packed training (Triton packed_lora) against swap mode, prefetching swaps on the
side stream against plain swaps, response log-probs against full logits in bf16, and shared-prompt
micro-batches against whole sequences. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from skyrl.train.config import AlgorithmConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.batch import TrainBatch
from skyrl_clora.trainer.logprobs import token_logprobs
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig
from skyrl_clora.trainer.trainer import Trainer, TrainerSettings

pytestmark = pytest.mark.gpu
TENANTS = (("A", 8, 16.0, 5e-3, 0), ("B", 16, 16.0, 2e-3, 1), ("C", 4, 12.0, 8e-3, 2))


def _trainer(model_dir: Path, slots: int, dtype: torch.dtype = torch.float32) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    routing, layers = attach_multi_lora(model, num_slots=slots, max_rank=16, trainable=True)
    store = AdapterStore(layers, num_slots=slots)
    for name, rank, alpha, lr, seed in TENANTS:
        weights = init_adapter(layers, rank, alpha, torch.Generator().manual_seed(seed))
        store.register(name, weights, LRSchedule(base_lr=lr), seed=seed)
    return Trainer(model, routing, layers, store, TrainerSettings(AlgorithmConfig(use_kl_loss=False),
                                                                  OptimizerConfig(), micro_batch_size=5))


def _batch(seed: int, rows: int) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 300, (int(torch.randint(4, 40, (1,), generator=generator)),), generator=generator).tolist()
               for _ in range(rows)]
    responses = [torch.randint(0, 300, (int(torch.randint(2, 30, (1,), generator=generator)),), generator=generator).tolist()
                 for _ in range(rows)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * len(r) for r in responses],
                      rewards=[float(i % 3 == 0) for i in range(rows)], group_ids=[f"g{i // 4}" for i in range(rows)],
                      rollout_logprobs=None)


def test_packed_equals_swap_on_the_gpu(micro_model_dir: Path) -> None:
    swap, packed = _trainer(micro_model_dir, 1), _trainer(micro_model_dir, 3)
    for step in range(2):
        batches = {name: _batch(10 * step + i, rows=8 + i) for i, (name, *_) in enumerate(TENANTS)}
        alone = {name: swap.train_step(name, batch)[1] for name, batch in batches.items()}
        together = dict(zip(batches, (m for _, m in packed.train_packed(list(batches.items())))))
        assert len({round(m["mean_token_logprob"], 5) for m in alone.values()}) == 3
        for name in batches:
            for key, value in alone[name].items():
                assert together[name][key] == pytest.approx(value, rel=1e-3, abs=1e-5), (name, key)
    for name, *_ in TENANTS:
        a, b = swap.store.tenants[name], packed.store.tenants[name]
        assert a.flat["master"].abs().sum() > 0
        # AdamW's first steps move each weight by about lr * sign(gradient): a weight whose gradient is within
        # float rounding of Adam's eps moves by a rounding-sensitive fraction of lr (2e-3 to 8e-3 here), so the
        # absolute tolerance is 1% of the smallest lr; a real difference between the modes moves weights by ~lr.
        torch.testing.assert_close(b.flat["master"], a.flat["master"], rtol=1e-3, atol=2e-5)


def test_prefetching_on_the_side_stream_gives_the_same_states(micro_model_dir: Path) -> None:
    plain, prefetching = _trainer(micro_model_dir, 1), _trainer(micro_model_dir, 2)
    assert prefetching.store._stream is not None
    order = ["A", "B", "C", "A", "C", "B"]
    for index, name in enumerate(order):
        batch = _batch(100 + index, rows=12)
        expected = plain.train_step(name, batch)[1]
        got = prefetching.train_step(name, batch, prefetch=order[(index + 1) % len(order)])[1]
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    for name, *_ in TENANTS:
        for table in ("master", "exp_avg", "exp_avg_sq", "grads"):
            a, b = plain.store.tenants[name].flat[table], prefetching.store.tenants[name].flat[table]
            assert a.is_pinned() and b.is_pinned()
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)


def test_bf16_response_logprobs_match_full_logits(micro_model_dir: Path) -> None:
    trainer = _trainer(micro_model_dir, 1, dtype=torch.bfloat16)
    batch = _batch(7, rows=6)
    trainer.train_step("B", batch)
    got = trainer.response_logprobs("B", batch)
    trainer.store.swap_in("B", 0)
    try:
        with torch.no_grad():
            for row, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
                ids = torch.tensor([prompt + response], device="cuda")
                with trainer.routing.route(torch.zeros(ids.numel(), dtype=torch.long, device="cuda")):
                    logits = trainer.model(input_ids=ids).logits.float()
                full = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
                torch.testing.assert_close(got[row, : len(response)], full[len(prompt) - 1 :], rtol=2e-2, atol=2e-2)
    finally:
        trainer.store.swap_out(0)


@pytest.mark.parametrize("max_tokens", [-1, 150])
def test_shared_prompts_on_the_gpu_match_whole_sequences(micro_model_dir: Path, max_tokens: int) -> None:
    """GRPO groups (4 samples of each of 3 prompts of different lengths), packed A and B, Triton LoRA:
    computing each prompt once gives the same metrics and master weights as whole sequences (fp32), in
    micro-batches of 5 rows or of up to ``max_tokens`` computed positions (several groups, both tenants)."""
    def grouped(seed: int) -> TrainBatch:
        generator = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 300, (9 + 11 * g,), generator=generator).tolist() for g in range(3)]
        responses = [torch.randint(0, 300, (int(torch.randint(2, 30, (1,), generator=generator)),), generator=generator).tolist()
                     for _ in range(12)]
        return TrainBatch(prompt_ids=[prompts[i // 4] for i in range(12)], response_ids=responses,
                          loss_masks=[[1] * len(r) for r in responses], rewards=[float(i % 3 == 0) for i in range(12)],
                          group_ids=[f"g{i // 4}" for i in range(12)], rollout_logprobs=None)

    shared, full = _trainer(micro_model_dir, 2), _trainer(micro_model_dir, 2)
    shared.shared_prefix, shared.max_tokens_per_microbatch = True, max_tokens
    for step in range(2):
        items = [("A", grouped(step)), ("B", grouped(step + 10))]
        got = [m for _, m in shared.train_packed(items)]
        want = [m for _, m in full.train_packed(items)]
        for a, b in zip(got, want):
            for key, value in b.items():
                assert a[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
    for name in ("A", "B"):
        a, b = full.store.tenants[name], shared.store.tenants[name]
        assert a.flat["master"].abs().sum() > 0
        # AdamW's first steps move each weight by about lr * sign(gradient): a weight whose gradient is within
        # float rounding of Adam's eps moves by a rounding-sensitive fraction of lr (2e-3 to 8e-3 here), so the
        # absolute tolerance is 1% of the smallest lr; a real difference between the modes moves weights by ~lr.
        torch.testing.assert_close(b.flat["master"], a.flat["master"], rtol=1e-3, atol=2e-5)


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_training_attention_runs_on_flash_or_memory_efficient_kernels(micro_model_dir: Path, shared_prefix: bool) -> None:
    """cuDNN's attention is off (a graph build per new shape) and neither the whole-sequence pass nor the
    shared-prompt passes may fall back to the math kernel: with only flash and memory-efficient attention
    allowed, SDPA raises instead."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    trainer = _trainer(micro_model_dir, 1, dtype=torch.bfloat16)
    trainer.shared_prefix = shared_prefix
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    batch = _batch(11, rows=8)
    batch.prompt_ids[:] = [batch.prompt_ids[i // 4 * 4] for i in range(8)]  # two GRPO groups of 4
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        metrics = trainer.train_step("A", batch)[1]
    assert metrics["grad_norm"] > 0


def test_segment_attention_on_flash_matches_its_reference_in_values_and_gradients() -> None:
    """bf16 flash-attention varlen call of ``SegmentLayout`` (GQA, bottom-right causal segments, prompt keys
    gathered in front of several responses) against the masked-SDPA reference computed in fp32."""
    from skyrl_clora.kernels.layers.gather_ops import inverse_index
    from skyrl_clora.trainer.prompt_segments import SegmentLayout

    generator = torch.Generator().manual_seed(0)
    prompts, responses, prefix_of = [37, 90], [13, 64, 1, 120], [0, 0, 1, 1]
    starts = [0, 37]
    tokens = sum(prompts) + sum(responses)
    key_index, q_lens, k_lens, cursor = list(range(sum(prompts))), list(prompts), list(prompts), sum(prompts)
    for length, prefix in zip(responses, prefix_of):
        key_index += list(range(starts[prefix], starts[prefix] + prompts[prefix])) + list(range(cursor, cursor + length))
        q_lens.append(length)
        k_lens.append(prompts[prefix] + length)
        cursor += length
    cumulative = lambda lengths: torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
    starts, sources = (torch.from_numpy(a).cuda() for a in inverse_index(np.array(key_index), tokens))
    layout = SegmentLayout(torch.tensor(key_index, device="cuda"), starts, sources, cumulative(q_lens), cumulative(k_lens),
                           q_lens, k_lens)
    q, k, v = (torch.randn(1, heads, tokens, 64, generator=generator).cuda() for heads in (8, 2, 2))
    grad = torch.randn(1, tokens, 8, 64, generator=generator).cuda()

    def run(dtype: torch.dtype) -> list[torch.Tensor]:
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = layout.attend(*inputs, scale=0.125)
        out.backward(grad.to(dtype))
        return [out.float()] + [t.grad.float() for t in inputs]

    for got, want in zip(run(torch.bfloat16), run(torch.float32)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_bf16_token_logprobs_and_gradients_at_qwen3_vocabulary_match_float64() -> None:
    """The Triton LM-head loss (``chosen_logprobs_``) in chunks, forward and backward, at Qwen3-1.7B's head."""
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(2048, 151936, bias=False).requires_grad_(False)
    head.weight.data.normal_(0.0, 0.02, generator=gen)
    hidden = torch.randn(1000, 2048, generator=gen)
    targets = torch.randint(0, 151936, (1000,), generator=gen)
    weights = torch.randn(1000, generator=gen)
    head_gpu = head.to("cuda", torch.bfloat16)
    hidden_gpu = hidden.to("cuda", torch.bfloat16).requires_grad_(True)
    got = token_logprobs(hidden_gpu, head_gpu, targets.cuda(), max_logits=300 * 151936)  # chunks of 300 rows
    (got * weights.cuda()).sum().backward()
    hidden64 = hidden_gpu.detach().double().requires_grad_(True)
    logits64 = hidden64 @ head_gpu.weight.double().T
    expected = torch.log_softmax(logits64, dim=-1).gather(1, targets.cuda()[:, None])[:, 0]
    (expected * weights.cuda().double()).sum().backward()
    assert got.std() > 0.1
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=0.05)  # bf16 logits: ~0.01 per logit
    cosine = torch.nn.functional.cosine_similarity(hidden_gpu.grad.double().flatten(), hidden64.grad.flatten(), dim=0)
    assert cosine > 0.999
    torch.testing.assert_close(hidden_gpu.grad.double(), hidden64.grad, rtol=0.05, atol=2e-3)
