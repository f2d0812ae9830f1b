"""The engine's adapter slots as a cache: more tenants than device slots, loaded on demand (least recently used out).
Many tenants on a few slots sample bit for bit what they sample with a slot each; a tenant whose slot keeps being
taken still gets served; a publish to an evicted or reloading tenant is what its next request is sampled with."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from skyrl_clora.kernels.reference import add_lora_ref
from skyrl_clora.sampler.engine import Engine
from skyrl_clora.sampler.engine_config import EngineConfig
from skyrl_clora.sampler.engine_thread import EngineThread
from skyrl_clora.sampler.fused_projections import attach_engine_lora
from skyrl_clora.sampler.requests import SamplingParams

from tests.support.engine_driver import (
    MAX_ROUNDS, PROMPT, make_adapters, make_engine, publish, register, run_until, sampled, submit,
)

def test_64_tenants_on_8_slots_sample_bit_for_bit_what_they_sample_on_64(micro_model_dir: Path) -> None:
    """Each tenant's three requests arrive 63 other tenants' requests apart, so on 8 slots every tenant is evicted
    and loaded again between them; tokens and log-probs equal the 64-slot run's exactly (the CPU reference's shapes
    change with the slot count, its results do not: every row's LoRA terms of other slots are exact zeros)."""
    weights = make_adapters(micro_model_dir, {f"t{i}": i for i in range(64)})
    runs, stats = {}, {}
    for slots in (64, 8):
        model = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
        _, layers = attach_engine_lora(model, num_slots=slots, max_rank=8)
        engine = EngineThread(Engine(model, layers, EngineConfig(num_rows=16, max_len=64)))
        try:
            for name, adapter in weights.items():
                engine.register_adapter(name, adapter)
            engine.pause()
            futures = [engine.submit(PROMPT[: 8 + k * 4], name, SamplingParams(max_tokens=3 + 2 * k, seed=k))
                       for k in range(3) for name in weights]
            engine.resume()
            runs[slots] = [sampled(future.result(timeout=300)) for future in futures]
            stats[slots] = engine.stats
        finally:
            engine.shutdown()
    assert len({tuple(logprobs) for _, logprobs, _ in runs[64][:64]}) == 64, "tenants' samples must differ"
    assert runs[8] == runs[64]
    counts = {slots: (s.adapter_hits, s.adapter_loads, s.adapter_evictions) for slots, s in stats.items()}
    assert counts == {64: (128, 64, 0), 8: (0, 192, 184)}, "on 8 slots every request finds its tenant evicted"
    assert (stats[64].adapter_hit_rate, stats[8].adapter_hit_rate) == (128 / 192, 0.0)


def test_the_cpu_lora_reference_gives_a_row_the_same_bits_whatever_the_slot_count_slot_and_batch() -> None:
    """``add_lora_ref`` (the CPU engine's LoRA): one GEMM over every slot's stacked A would pick another kernel for
    one slot's 8 columns than for 16 and change the last bits; the per-row products do not."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 8, 64, generator=generator), torch.randn(64, 96, 8, generator=generator)
    scales, x = torch.rand(64, generator=generator), torch.randn(16, 64, generator=generator)
    slots = torch.randint(0, 64, (16,), generator=generator)
    slots[3] = -1  # a row without adapter
    want = torch.zeros(16, 96)
    add_lora_ref(want, x, a, (b,), scales, slots)
    assert want[3].abs().max() == 0 and want.abs().min(dim=1).values[slots >= 0].gt(0).all()
    for count in (1, 2, 8):
        for row in range(16):
            place = row % count
            a_few, b_few, scales_few = torch.zeros(count, 8, 64), torch.zeros(count, 96, 8), torch.zeros(count)
            if slots[row] >= 0:
                a_few[place], b_few[place], scales_few[place] = a[slots[row]], b[slots[row]], scales[slots[row]]
            for rows in ([row], list(range(max(0, row - 5), row + 1))):  # alone, and last of a batch
                got = torch.zeros(len(rows), 96)
                row_slots = torch.full((len(rows),), place if slots[row] >= 0 else -1)
                add_lora_ref(got, x[rows], a_few, (b_few,), scales_few, row_slots)
                assert torch.equal(got[-1], want[row]), (count, row, len(rows))


def test_a_tenant_whose_slot_keeps_being_taken_is_served_while_another_floods_the_engine(micro_model_dir: Path) -> None:
    """One slot; tenant a submits a request every round (its rows never all finish on their own), tenant x three
    requests one after another. Each x request waits for the slot, a is drained for it (a's requests queued behind
    it wait), x is loaded, a evicted, and back: every request completes exactly as with a slot each."""
    weights = make_adapters(micro_model_dir, {"a": 1, "x": 2})
    engine = make_engine(micro_model_dir, slots=1)
    register(engine, weights)
    flood, served = [], []
    current = None
    for round_ in range(MAX_ROUNDS):
        flood.append((round_, submit(engine, "a", seed=round_, max_tokens=5)))
        if round_ >= 3 and (current is None or current[1].done()) and len(served) < 3:
            current = (len(served), submit(engine, "x", seed=100 + len(served), max_tokens=8))
            served.append(current)
        engine.step()
        if len(served) == 3 and served[-1][1].done():
            break
    assert all(future.done() for _, future in served), "x starved"
    run_until(engine, lambda: all(future.done() for _, future in flood))
    assert engine.stats.adapter_evictions >= 6, "x took a's slot and a took it back, three times"

    alone = make_engine(micro_model_dir, slots=2)
    register(alone, weights)
    expected_x = [submit(alone, "x", seed=100 + i, max_tokens=8) for i, _ in served]
    expected_a = [submit(alone, "a", seed=round_, max_tokens=5) for round_, _ in flood]
    run_until(alone, lambda: all(future.done() for future in expected_x + expected_a))
    assert [sampled(f.result()) for _, f in served] == [sampled(f.result()) for f in expected_x]
    assert [sampled(f.result()) for _, f in flood] == [sampled(f.result()) for f in expected_a]
    assert served[0][1].result().token_ids != flood[0][1].result().token_ids, "tenants' samples must differ"


def test_a_publish_to_an_evicted_or_reloading_tenant_is_what_its_next_request_samples(micro_model_dir: Path) -> None:
    """One slot, tenants a and b: a's publish lands once its request is done and b takes its slot in the same round;
    a publish to a while evicted updates only its host copy and version; a request of a then waits for the slot with
    one more publish queued behind it, and is loaded and sampled with that latest version, never an older one."""
    weights = make_adapters(micro_model_dir, {"a": 1, "b": 2, "a1": 11, "a2": 12, "a3": 13})
    engine = make_engine(micro_model_dir, slots=1)
    register(engine, {"a": weights["a"], "b": weights["b"]})
    first_a = submit(engine, "a", seed=7)
    engine.step()
    assert engine.adapters.resident("a") and not first_a.done()
    first_b = submit(engine, "b", seed=8, max_tokens=30)
    publish_1 = publish(engine, "a", weights["a1"], 1)
    run_until(engine, publish_1.done)
    assert first_a.done() and engine.adapters.version("a") == 1
    assert engine.adapters.resident("b") and not engine.adapters.resident("a"), "b took a's slot as a's publish landed"

    publish_2 = publish(engine, "a", weights["a2"], 2)
    engine.step()
    assert publish_2.done() and not first_b.done(), "a publish to an evicted tenant waits for nothing"
    assert engine.adapters.version("a") == 2 and not engine.adapters.resident("a")
    second_a = submit(engine, "a", seed=7)
    publish_3 = publish(engine, "a", weights["a3"], 3)
    run_until(engine, second_a.done)
    assert publish_3.done() and engine.stats.adapter_evictions == 2

    reference = make_engine(micro_model_dir, slots=3)
    register(reference, {"v0": weights["a"], "v3": weights["a3"], "b": weights["b"]})
    expected = [submit(reference, "v0", seed=7), submit(reference, "b", seed=8, max_tokens=30),
                submit(reference, "v3", seed=7)]
    run_until(reference, lambda: all(future.done() for future in expected))
    got = [first_a.result(), first_b.result(), second_a.result()]
    assert [c.adapter_version for c in got] == [0, 0, 3]
    assert [sampled(c) for c in got] == [sampled(f.result()) for f in expected]
    assert got[0].token_ids != got[2].token_ids, "a's versions must sample differently"
