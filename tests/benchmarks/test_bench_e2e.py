"""The end-to-end benchmark's workload on the CPU (no model): the per-turn length sampler (``--lengths``), an
episode driven by a stub engine, the run config's length limits and the GPU-busy arithmetic."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import statistics
import sys
from types import SimpleNamespace

import pytest

from benchmarks import e2e, wall
from benchmarks.common import write_random_model
from benchmarks.workloads import PRESETS, Lengths, length_summary, parse_lengths
from skyrl_clora.sampler.requests import Completion
from skyrl_clora.sampler.engine_stats import EngineStats
from skyrl_clora.trainer.scheduler import TrainPass

KEYS = [(seed, step, episode, turn)
        for seed in (0, 1, 7) for step in (1, 2) for episode in range(64) for turn in range(3)]


@pytest.mark.parametrize("spec", ["longtail", "hard", "lognormal:median=40,sigma=0.5,cap=60", "fixed:7"])
def test_a_turns_length_does_not_depend_on_the_order_of_draws(spec):
    forward = {key: parse_lengths(spec).draw(*key) for key in KEYS}
    shuffled = list(KEYS)
    random.Random(3).shuffle(shuffled)
    other = parse_lengths(spec)  # a fresh sampler: no state carried between draws
    assert {key: other.draw(*key) for key in shuffled} == forward
    assert all(isinstance(length, int) for length in forward.values())


def test_draws_differ_between_tenants_steps_episodes_and_turns():
    lengths = parse_lengths("longtail")
    base = (1, 1, 0, 0)
    for index in range(4):
        varied = [[*base] for _ in range(20)]
        for k, key in enumerate(varied):
            key[index] += k + 1
        assert len({lengths.draw(*key) for key in varied}) > 5, index


@pytest.mark.parametrize("spec, median, sigma, cap", [("longtail", 128, 1.0, 512), ("hard", 300, 0.9, 1024),
                                                      ("lognormal:median=50,sigma=0.3,cap=2000", 50, 0.3, 2000)])
def test_lognormal_draws_follow_their_parameters(spec, median, sigma, cap):
    lengths = parse_lengths(spec)
    assert (lengths.kind, lengths.median, lengths.sigma, lengths.cap) == ("lognormal", median, sigma, cap)
    draws = [lengths.draw(seed, step, episode, turn) for seed in range(4) for step in range(1, 6)
             for episode in range(100) for turn in range(4)]  # 8000 draws
    assert 1 <= min(draws) and max(draws) <= cap
    assert abs(statistics.median(draws) / median - 1) < 0.05
    p90 = sorted(draws)[int(0.9 * len(draws))]
    expected_p90 = min(cap, median * 3.6022 ** sigma)  # exp(1.2816 sigma): the lognormal's 90th percentile
    assert abs(p90 / expected_p90 - 1) < 0.08
    if cap < median * 10:  # the presets' caps bind for the top few per cent: the tail is clipped, not dropped
        assert 0.005 < sum(d == cap for d in draws) / len(draws) < 0.2


def test_presets_are_their_lognormal_specs():
    assert parse_lengths("longtail") == parse_lengths("lognormal:median=128,sigma=1.0,cap=512")
    assert parse_lengths("hard") == parse_lengths("lognormal:median=300,sigma=0.9,cap=1024")
    assert parse_lengths(parse_lengths("hard").spec) == parse_lengths("hard") and set(PRESETS) == {"longtail", "hard"}


def test_fixed_gives_its_length_everywhere():
    lengths = parse_lengths("fixed:100")
    assert lengths == Lengths("fixed", 100) and lengths.spec == "fixed:100"
    assert {lengths.draw(*key) for key in KEYS} == {100}


@pytest.mark.parametrize("spec", ["lognormal:median=-1", "lognormal:median=-1,sigma=1,cap=10", "zipf:3", "fixed:0",
                                  "fixed:abc", "fixed", "", "lognormal:median=10,sigma=-1,cap=10",
                                  "lognormal:median=10,sigma=1,cap=0", "lognormal:median=10,sigma=1,cap=5.5",
                                  "lognormal:median=nan,sigma=1,cap=5", "lognormal:median=10,sigma=1",
                                  "lognormal:median=10,sigma=1,cap=5,mean=3", "lognormal:median10,sigma=1,cap=5"])
def test_a_bad_spec_names_the_accepted_forms_in_one_line(spec):
    with pytest.raises(ValueError) as raised:
        parse_lengths(spec)
    message = str(raised.value)
    assert "\n" not in message and repr(spec) in message
    for form in ("fixed:N", "lognormal:median=M,sigma=S,cap=C", "longtail", "hard"):
        assert form in message


def test_the_command_line_rejects_a_bad_spec_before_building_anything(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["e2e", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o.json"),
                                      "--lengths", "zipf:3"])
    with pytest.raises(SystemExit) as raised:
        e2e.main()
    assert raised.value.code == 2 and "fixed:N" in capsys.readouterr().err


def test_the_command_line_rejects_warmup_tenants_beyond_the_largest_n(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["e2e", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o.json"),
                                      "--tenants", "2", "4", "--warmup-tenants", "8"])
    with pytest.raises(SystemExit) as raised:
        e2e.main()
    assert raised.value.code == 2 and "--warmup-tenants 8: give 1 to the largest --tenants (4)" in capsys.readouterr().err


def test_length_summary():
    assert length_summary([5, 1, 3, 2, 4, 6, 7, 8, 9, 10]) == {"count": 10, "mean": 5.5, "p50": 5.0, "p90": 9.0,
                                                               "max": 10.0}
    assert length_summary([])["count"] == 0


class StubEngine:
    """Answers every request at once with exactly ``max_tokens`` tokens, recording (prompt length, max_tokens)."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, int]] = []

    def submit(self, prompt_ids, adapter, params) -> concurrent.futures.Future:
        self.requests.append((len(prompt_ids), params.max_tokens))
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(Completion([5] * params.max_tokens, [0.0] * params.max_tokens, "length", 0))
        return future


@pytest.mark.parametrize("spec", ["fixed:100", "longtail", "hard"])
def test_episodes_fit_the_run_configs_lengths_and_repeat_in_any_order(spec, tmp_path):
    workload = e2e.Workload(lengths=parse_lengths(spec))
    (tmp_path / "config.json").write_text("{}")
    recipe = e2e.run_config(tmp_path, workload, "swap", 2, "cpu").recipe
    # The longest episode the distribution allows: every turn at the cap.
    assert recipe.max_generate_length == workload.lengths.cap
    longest_context = workload.prompt + (workload.turns - 1) * (workload.lengths.cap + workload.observation)
    assert recipe.max_input_length >= longest_context

    def run(order: list[int]) -> tuple[dict, StubEngine]:
        engine = StubEngine()
        services = SimpleNamespace(engine=engine)
        prompt = list(range(workload.prompt))

        async def main() -> dict:
            results = {}
            for index in order:
                drawn: list[int] = []
                response, mask, short = await e2e.episode(services, "t", 3, 1, index, prompt, workload, drawn)
                results[index] = (response, mask, short, drawn)
            return results

        return asyncio.run(main()), engine

    forward, engine = run(list(range(16)))
    backward, _ = run(list(reversed(range(16))))
    assert forward == backward
    for index, (response, mask, short, drawn) in forward.items():
        assert short == 0 and drawn == [workload.lengths.draw(3, 1, index, turn) for turn in range(workload.turns)]
        assert sum(mask) == sum(drawn) and len(response) == sum(drawn) + (workload.turns - 1) * workload.observation
    for prompt_len, max_tokens in engine.requests:
        assert prompt_len <= recipe.max_input_length
        assert prompt_len + max_tokens <= recipe.max_input_length + recipe.max_generate_length


def test_gpu_busy_bounds():
    stats = EngineStats(decode_gpu_seconds=2.0, prefill_gpu_seconds=0.5, prefill_copy_gpu_seconds=0.5)
    result = e2e.ModeResult("swap", 2, 10.0, [1.0], engine=stats, train_passes_s=4.0)
    busy = wall.gpu_busy(result)
    assert busy["engine_gpu_s"] == 3.0 and busy["train_pass_s"] == 4.0
    assert busy["lower"] == pytest.approx(0.4) and busy["upper"] == pytest.approx(0.7)
    result.wall_s = 5.0
    assert wall.gpu_busy(result)["upper"] == 1.0  # the sum of overlapping spans is capped
    assert wall.gpu_busy(result)["union"] is None  # not measured off CUDA
    result.gpu_union_s = 4.5
    assert wall.gpu_busy(result)["union"] == pytest.approx(0.9)


def test_union_seconds_counts_overlaps_once_within_the_window():
    intervals = [(3.0, 5.0), (0.5, 2.0), (1.0, 1.5), (4.0, 7.0), (9.0, 12.0), (-2.0, -1.0)]
    # covered: [1, 2] (from 0.5), [3, 7], [9, 10] within [1, 10]
    assert wall.union_seconds(intervals, 1.0, 10.0) == pytest.approx(1.0 + 4.0 + 1.0)
    assert wall.union_seconds([], 0.0, 1.0) == 0.0


def _result(wall: float, lengths: list[int], tenants: int = 1, mode: str = "swap") -> e2e.ModeResult:
    step = e2e.StepRecord("t", 1, 1.0, 2.0, 0.1, 3.1, sum(lengths))
    return e2e.ModeResult(mode, tenants, wall, [0.5], [step], EngineStats(decode_gpu_seconds=1.0), 2.0,
                          train_passes_s=2.0, turn_lengths=lengths)


def test_table_rows_compare_the_same_experiments_or_else_the_serial_rate():
    """N within the serial experiments run: their serial wall over the concurrent wall; above (``--serial K``):
    experiments per hour over the K serial experiments' rate."""
    serial = [_result(10.0, [1]), _result(12.0, [2])]
    concurrent = {("swap", 2): _result(11.0, [1, 2], 2), ("swap", 4): _result(20.0, [1, 2, 3, 4], 4)}
    rows = e2e.table_rows(serial, concurrent, [2, 4], ["swap"])
    assert [(row["mode"], row["tenants"]) for row in rows] == [("serial", 2), ("swap", 2), ("swap", 4)]
    assert rows[1]["throughput_vs_serial"] == pytest.approx(22.0 / 11.0)
    assert rows[2]["throughput_vs_serial"] == pytest.approx((4 / 20.0) / (2 / 22.0))
    assert rows[2]["serial_basis"] == "the rate of 2" and rows[1]["serial_basis"] == "the same 2"
    assert rows[2]["experiments_per_hour"] == pytest.approx(4 / 20.0 * 3600)


def test_serial_groups_add_up():
    one = _result

    group = e2e.combine([one(10.0, [1, 2]), one(20.0, [3])], "serial")
    row = e2e.summarize(group)
    assert (row["wall_s"], row["tenants"], row["cold_start_s"]) == (30.0, 2, [0.5, 0.5])
    assert row["gpu_busy"]["upper"] == pytest.approx(6.0 / 30.0) and row["turn_lengths"]["count"] == 3


def test_overlap_splits_the_window_by_what_covers_it():
    rollouts, passes = [(0.0, 4.0), (3.0, 6.0)], [(5.0, 7.0), (8.0, 9.0)]
    shares = wall.overlap(rollouts, passes, 0.0, 10.0)
    assert shares == pytest.approx({"both": 1.0, "first_only": 5.0, "second_only": 2.0, "neither": 2.0})


def _step(tenant: str, step: int, started: float, rollout: float, train: float, sync: float, host: float):
    trained = started + rollout + host
    return e2e.StepRecord(tenant, step, rollout, train, sync, rollout + host + train + sync, 0, started=started,
                          trained=trained)


def test_tenant_phases_match_each_step_to_its_pass_and_add_up_to_the_wall():
    """B waited 0.55 s behind A's pass, A's second pass 1 s; a pass outside its step's train call is refused."""
    steps = [_step("A", 1, 0.0, 2.0, 1.0, 0.1, 0.05), _step("B", 1, 0.0, 2.5, 1.0, 0.1, 0.0),
             _step("A", 2, 3.15, 2.0, 2.0, 0.1, 0.05)]
    passes = [TrainPass(("A",), (2.05,), 2.05, 3.05, False, None), TrainPass(("B",), (2.5,), 3.05, 3.5, False, None),
              TrainPass(("A",), (5.2,), 6.2, 7.2, False, None)]
    phases = wall.tenant_phases(steps, passes)
    a = phases["A"]
    assert a["steps"] == 2 and a["wall_s"] == pytest.approx(3.15 + 4.15)
    assert (a["rollout_s"], a["training_s"], a["trainer_queue_s"], a["publish_s"]) == pytest.approx((4.0, 2.0, 1.0, 0.2))
    assert a["host_s"] == pytest.approx(0.1)
    assert phases["B"]["training_s"] == pytest.approx(0.45) and phases["B"]["trainer_queue_s"] == pytest.approx(0.55)
    with pytest.raises(ValueError, match="outside its train call"):
        wall.tenant_phases(steps, [*passes[:2], TrainPass(("A",), (5.2,), 4.0, 5.0, False, None)])
    with pytest.raises(ValueError, match="2 steps but 1 training passes"):
        wall.tenant_phases(steps, passes[:2])


@pytest.mark.parametrize("overlap", ["true", "false"])
@pytest.mark.e2e
def test_a_concurrent_groups_wall_account_adds_up(micro_model_dir, tmp_path, overlap):
    """Two tenants, two steps at the smallest CPU size. Each tenant's phases cover its wall (the host work between
    them, building a batch, is at most a tenth of it); the tenants' passes are the trainer's; the engine thread's
    counters cover its life but for its loop's bookkeeping (at most a tenth); sampling paused only for passes that
    paused it (clora.overlap_sampling=false: every pass; true: none), and for no longer than they ran."""
    model_dir = tmp_path / "tiny"
    write_random_model("tiny", micro_model_dir, model_dir, "cpu", vocab_size=1024)
    workload = e2e.Workload(prompt=16, lengths=parse_lengths("fixed:4"), turns=2, prompts=1, samples=2, steps=2,
                            overrides=(f"clora.overlap_sampling={overlap}",))
    result = e2e.run_group(model_dir, workload, "swap", ["a", "b"], [1, 2], "cpu")
    account = result.account
    assert account["wall_s"] == pytest.approx(result.wall_s)
    assert account["setup_s"] + account["engine_life_s"] == pytest.approx(account["wall_s"])
    for name, tenant in account["tenants"].items():
        phases = [tenant[f"{phase}_s"] for phase in wall.TENANT_PHASES]
        assert sum(phases) == pytest.approx(tenant["wall_s"]) and tenant["steps"] == 2, name
        assert min(phases) >= -1e-6 and tenant["host_s"] <= 0.1 * tenant["wall_s"], (name, tenant)
        assert tenant["wall_s"] <= account["engine_life_s"]
    trainer, engine = account["trainer"], account["engine"]
    assert trainer["passes"] == 4 and sum(t["training_s"] for t in account["tenants"].values()) == pytest.approx(
        trainer["pass_s"])
    life = account["engine_life_s"]
    counted = sum(engine[key] for key in ("decode_s", "prefill_s", "other_busy_s", "paused_s", "idle_s"))
    assert counted + engine["unaccounted_s"] == pytest.approx(life)
    assert abs(engine["unaccounted_s"]) <= 0.1 * life, engine
    # 2 tenants x 2 steps x 2 episodes x 2 turns of 4 tokens: the first of each by prefill, the other 3 by decode
    # steps of at most 4 rows (2 tenants x 2 episodes)
    assert result.engine.generated_tokens == 64 and result.engine.preemptions == 0
    assert 1 <= engine["rows_per_step"] <= 4 and engine["rows_per_step"] * engine["decode_steps"] == pytest.approx(48)
    assert trainer["paused_passes"] == (4 if overlap == "false" else 0)
    if overlap == "false":
        assert 0 < engine["paused_s"] <= trainer["paused_pass_s"] + 0.05 * trainer["passes"]
    else:
        assert engine["paused_s"] == 0
    run = account["run_window"]
    assert sum(run[key] for key in run if key != "window_s") == pytest.approx(run["window_s"])
    assert "wall account" in wall.describe("swap x2", account)


def test_tenants_on_one_adapter_slot_train_and_the_group_counts_its_loads(micro_model_dir, tmp_path):
    """Two tenants, two steps, one engine adapter slot (``sampler.adapter_slots=1``): their rollouts take the slot in
    turn (each publish to the evicted tenant lands in its host copy), every token is sampled, and the group's
    counters and row count the loads and evictions."""
    model_dir = tmp_path / "tiny"
    write_random_model("tiny", micro_model_dir, model_dir, "cpu", vocab_size=1024)
    workload = e2e.Workload(prompt=16, lengths=parse_lengths("fixed:4"), turns=2, prompts=1, samples=2, steps=2,
                            overrides=("sampler.adapter_slots=1",))
    result = e2e.run_group(model_dir, workload, "swap", ["a", "b"], [1, 2], "cpu")
    assert result.engine.generated_tokens == 64
    stats = result.engine
    assert stats.adapter_evictions == stats.adapter_loads - 1 >= 3, "each tenant's step took the slot from the other"
    row = e2e.summarize(result)
    assert (row["adapter_loads"], row["adapter_evictions"]) == (stats.adapter_loads, stats.adapter_evictions)
    assert row["adapter_hit_rate"] == stats.adapter_hit_rate < 1
    assert {tenant: w["requests"] for tenant, w in row["queue_waits"].items()} == {"a": 8, "b": 8}, "2 steps x 2 x 2 turns"
    assert 0 <= row["queue_wait_p50_s"] <= row["queue_wait_p99_s"] == max(w["p99_s"] for w in row["queue_waits"].values())
    totals = sorted(w["total_s"] for w in row["queue_waits"].values())
    assert (row["tenant_wait_total_median_s"], row["tenant_wait_total_max_s"]) == (sum(totals) / 2, totals[-1])
    step_means = sorted(statistics.mean(s.step_s for s in result.steps if s.tenant == t) for t in ("a", "b"))
    assert (row["tenant_step_median_s"], row["tenant_step_max_s"]) == (sum(step_means) / 2, step_means[-1])
