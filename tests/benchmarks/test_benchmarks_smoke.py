"""Every benchmark module runs: each ``benchmarks.<name>`` command line (its ``main(argv)``) at its smallest size on
the CPU, where the GPU benchmarks take tiny shapes (``--smoke``, ``--shape tiny``) and their Triton kernels run
through the Triton interpreter (``TRITON_INTERPRET=1``, set by scripts/test.sh). Each run must end normally and
write its output; its figures are not checked (they say nothing on a CPU). ``benchmarks.workloads`` is a helper
(its code runs in the e2e run; ``tests/benchmarks/test_bench_e2e.py`` tests it and e2e's parts)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import (admission, attention, common, concurrency, decode_factors, e2e, engine, engine_host,
                        interference, kernels, planner, qkv_rope, runner, skyrl_profile, tinker_clients,
                        tinker_requests, train)
from skyrl_clora.backends.skyrl.backend import STEP_PHASES
from tests.support.markers import triton_runs

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
HELPERS = {"workloads", "packed", "wall"}  # imported by the runnable modules (packed: by kernels, wall: by e2e)
RUNS = {"admission", "attention", "common", "concurrency", "decode_factors", "e2e", "engine", "engine_host",
        "interference", "kernels", "planner", "qkv_rope", "runner", "skyrl_profile", "tinker_clients",
        "tinker_requests", "train"}


def test_every_benchmark_module_has_a_run_here():
    modules = {path.stem for path in BENCHMARKS.glob("*.py")} - {"__init__"}
    assert modules == RUNS | HELPERS


def read_json(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


@triton_runs
def test_attention(tmp_path):
    attention.main(["--smoke", "--paged", "16", "--out", str(tmp_path)])
    results = read_json(tmp_path / "bench_attention.json")
    assert len(results["table"]) == 2 and all("paged_s" in row for row in results["table"])
    assert (tmp_path / "bench_attention.md").is_file()


@triton_runs
def test_kernels_and_packed_training(tmp_path):
    kernels.main(["--smoke", "--tokens", "4", "--ranks", "8", "--adapters", "2", "--out", str(tmp_path)])
    results = read_json(tmp_path / "bench_kernels.json")
    assert [row["shape"] for row in results["table"]] == ["tiny", "tiny.qkv"]
    assert not [row for row in results["table"] if "error" in row]  # a failed row is only reported by the script
    assert "packed_graph_s" in results["packed"] and len(results["meta_build"]) == 1


@triton_runs
def test_qkv_rope(tmp_path):
    qkv_rope.main(["--smoke", "--adapters", "2", "--tokens", "4", "--out", str(tmp_path)])
    assert len(read_json(tmp_path / "bench_qkv_rope.json")["rows"]) == 1


@triton_runs
def test_runner(tmp_path):
    out = tmp_path / "runner.json"
    runner.main(["--shape", "tiny", "--tenants", "2", "--spans", "16", "--samples", "4", "--prompt", "16", "--context",
                 "40", "--jobs", "4", "--history", "24", "--observation", "7", "--repeats", "1",
                 "--attention-configs", "16/16/1/1", "--profile", "--out", str(out)])
    cases = [case["case"] for case in read_json(out)["cases"]]
    assert cases == ["decode", "prefill turn", "prefill attention, one layer", "prefill prompt"]
    assert (tmp_path / "runner.decode16.shared.txt").is_file()


@triton_runs
def test_interference(tmp_path):
    interference.main(["--shape", "tiny", "--rows", "16", "--prompt", "8", "--lengths", "fixed:4", "--turns", "2",
                       "--observation", "2", "--prompts", "2", "--samples", "2", "--tenants", "2", "--steps", "3",
                       "--passes", "2", "--out", str(tmp_path)])
    report = read_json(tmp_path / "interference.json")
    assert list(report["rows"]) == ["decode alone", "decode beside training", "pass alone", "pass beside decoding"]
    assert len(report["steps_alone"]) == 3 and len(report["rows"]["pass beside decoding"]["passes_s"]) == 2


def test_interference_table_when_no_decode_step_fell_inside_a_pass(capsys):
    """A loaded CPU may finish every pass before the decode thread gets a step in: the report says so."""
    rows = {"decode alone": {"period_ms": 2.0, "gpu_ms": None, "steps": 3},
            "decode beside training": {"period_ms": interference.median([]), "gpu_ms": None, "steps": 0},
            "pass alone": {"pass_s": 0.5, "passes_s": [0.5], "mfu": [0.1]},
            "pass beside decoding": {"pass_s": 0.6, "passes_s": [0.6], "mfu": [0.1]}}
    summary = {"decode_period_slowdown": interference.ratio(None, 2.0), "decode_gpu_slowdown": None,
               "pass_slowdown": 1.2, "overlapped_wall_s": 1.0, "sum_of_parts_s": 0.9, "wall_over_parts": 1.1,
               "overlapped": "1 passes and 0 decode steps"}
    interference.print_table(rows, summary)
    assert "no step fell inside a pass" in capsys.readouterr().out


@triton_runs
def test_decode_factors(tmp_path):
    decode_factors.main(["--shape", "tiny", "--rows", "12", "--num-rows", "32", "--span", "32", "--prompt", "128",
                         "--lengths", "fixed:4", "--turns", "2", "--observation", "2", "--prompts", "2", "--samples",
                         "4", "--tenants", "2", "--max-len", "256", "--advance", "4", "--pool-blocks", "64",
                         "--steps", "3", "--out", str(tmp_path)])
    cases = read_json(tmp_path / "decode_factors.json")["cases"]
    assert list(cases) == list(decode_factors.CASES) and all(len(case["steps"]) == 3 for case in cases.values())
    assert (cases["baseline"]["span"], cases["span"]["span"], cases["e2e"]["num_rows"]) == (16, 32, 32)


def test_decode_factors_layout_places_rows_as_the_case_says():
    """The span case's highest row sets the span; paged groups hold their prompt blocks by reference and every other
    block once; only the sharing groups' rows read their prompt through another row."""
    positions = [200 + 7 * i for i in range(24)]  # 3 groups of 8 rows, prompt 128 (1 block)
    factors = decode_factors.Factors(num_rows=64, span=48, shared_fraction=1 / 3, paged=True)
    layout = decode_factors.make_layout(positions, factors, 128, 8, 2, 512, 4, 100, random.Random(0))
    rows = layout.rows.tolist()
    assert len(set(rows)) == 24 and rows == sorted(rows) and rows[-1] == 47 and layout.span == 48
    tables = layout.tables[rows]
    assert all(len({tables[i, 0] for i in range(g, g + 8)}) == 1 for g in range(0, 24, 8))
    owned = [int(b) for i, p in enumerate(positions) for b in tables[i, 1 : (p + 3) // 128 + 1]]
    assert len(owned) == len(set(owned)) and not set(owned) & set(tables[:, 0].tolist())
    assert max(owned) < 100 and (layout.tables[layout.num_rows] == 100).all()
    assert layout.borrowed == 7 * 128 and sum(n > 0 for n in layout.prefix_lens) == 8
    assert layout.slots.tolist() == [0] * 8 + [1] * 8 + [0] * 8
    packed = decode_factors.make_layout(positions, decode_factors.Factors(shared_fraction=0.0), 128, 8, 2, 512, 4,
                                        100, random.Random(0))
    assert packed.rows.tolist() == list(range(24)) and packed.num_rows == packed.span == 32 and packed.borrowed == 0
    with pytest.raises(ValueError, match="blocks"):
        decode_factors.make_layout(positions, factors, 128, 8, 2, 512, 4, 20, random.Random(0))


def test_engine(tmp_path):
    out = tmp_path / "engine.json"
    engine.main(["--shape", "tiny", "--batches", "2", "--prompt", "8", "--new", "3", "--repeats", "1", "--profile",
                 "--out", str(out)])
    results = read_json(out)
    assert len(results["engine"]) == 4 and len(results["hf"]) == 3 and "profile" in results


def test_engine_host(tmp_path):
    out = tmp_path / "engine_host.json"
    engine_host.main(["--rows", "16", "--steps", "2", "--repeats", "1", "--out", str(out)])
    assert list(read_json(out)["host_ms_per_decode_step"]) == ["16"]
    engine_host.main(["--rows", "16", "--steps", "2", "--repeats", "1", "--waiting", "3", "--admission", "fair",
                      "--out", str(out)])
    assert read_json(out)["waiting_tenants"] == 3


def test_admission(tmp_path):
    out = tmp_path / "admission.json"
    admission.main(["--tenants", "2", "--prompts", "1", "--samples", "2", "--prompt", "16", "--lengths", "fixed:8",
                    "--kv-blocks", "4", "--out", str(out)])
    rows = read_json(out)["rows"]
    assert [row["reserve_kv"] for row in rows] == [True, False]
    assert all(row["prompt_tokens_computed"] >= row["distinct_prompt_tokens"] > 0 for row in rows)


def test_train(tmp_path):
    train.main(["--shape", "tiny", "--workloads", "tiny", "--repeats", "1", "--warmup", "0", "--modes", "packed",
                "--out", str(tmp_path)])
    assert [row["mode"] for row in read_json(tmp_path / "bench_train.json")["rows"]] == ["swap", "packed"]


@pytest.mark.e2e
def test_e2e(tmp_path, micro_model_dir):
    out = tmp_path / "e2e.json"
    e2e.main(["--shape", "tiny", "--tokenizer", str(micro_model_dir), "--device", "cpu", "--tenants", "1",
              "--warmup-tenants", "1", "--modes", "swap", "--steps", "1", "--response", "1", "--prompts", "1", "--samples", "2",
              "--prompt", "16", "--out", str(out)])
    rows = read_json(out)["rows"]
    assert [(row["mode"], row["tenants"]) for row in rows] == [("serial", 1), ("swap", 1)]
    assert all(row["short_turns"] == 0 for row in rows)


@pytest.mark.e2e
def test_concurrency(tmp_path, micro_model_dir):
    concurrency.main(["--out", str(tmp_path), f"trainer.policy.model.path={micro_model_dir}", "preset=demo", "+tenants=2",
                      "trainer.max_training_steps=1", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
                      "recipe.eval_prompts=2", "generator.sampling_params.max_generate_length=4",
                      "generator.max_turns=1", "trainer.max_prompt_length=400", "clora.progress=false"])
    rows = read_json(tmp_path / "bench_concurrency.json")["rows"]
    assert [(row["mode"], row["tenants"]) for row in rows] == [("concurrent", 2), ("serial", 2)]


@pytest.mark.e2e
def test_tinker_clients(tmp_path, micro_model_dir):
    tinker_clients.main(["--tenants", "2", "--device", "cpu", "--out", str(tmp_path),
                         f"trainer.policy.model.path={micro_model_dir}", "preset=demo", "trainer.max_training_steps=1",
                         "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2", "recipe.eval_prompts=2",
                         "generator.sampling_params.max_generate_length=4", "generator.max_turns=1",
                         "trainer.max_prompt_length=400"])
    report = read_json(tmp_path / "tinker_clients.json")
    assert [row["run"] for row in report["rows"]] == ["tinker concurrent", "tinker serial", "main concurrent",
                                                      "main serial", "tinker serial, a cold start each"]
    assert all(row["tenants"] == 2 for row in report["rows"]) and (tmp_path / "server.log").is_file()
    for parts in report["cpu_seconds"].values():
        assert parts["wall"] > 0 and parts["clients"] > 0 and parts["server_api"] > 0 and parts["server_engine"] > 0


@pytest.mark.e2e
def test_tinker_requests(tmp_path, micro_model_dir):
    tinker_requests.main(["--device", "cpu", "--model", str(micro_model_dir), "--in-flight", "1", "4", "--requests",
                          "8", "--out", str(tmp_path)])
    report = read_json(tmp_path / "tinker_requests.json")
    assert [(row["in_flight"], row["requests"]) for row in report["rows"]] == [(1, 8), (4, 8)]
    assert all(row["requests_per_s"] > 0 and row["cpu_ms_per_request"]["server_api"] > 0 for row in report["rows"])


@pytest.mark.e2e
@pytest.mark.ray
def test_skyrl_profile(tmp_path, micro_model_dir):
    """On the CPU backend=skyrl runs the embedded stand-in workers (``--strategy embedded``)."""
    skyrl_profile.main(["--model-path", str(micro_model_dir), "--strategy", "embedded", "--steps", "1",
                        "--tenants", "1", "--out", str(tmp_path), "trainer.train_batch_size=2",
                        "generator.n_samples_per_prompt=2", "recipe.eval_prompts=2",
                        "generator.sampling_params.max_generate_length=4", "generator.max_turns=1",
                        "trainer.max_prompt_length=400"])
    runs = read_json(tmp_path / "skyrl_profile.json")["runs"]
    assert {path.name for path in (tmp_path / "skyrl").iterdir()} == {"run.log", "summary.json", "metrics.jsonl"}
    assert list(runs) == ["embedded", "skyrl"] and runs["skyrl"]["strategy"] == "embedded"
    assert set(runs["skyrl"]["fields"]) == set(skyrl_profile.FIELDS) and runs["skyrl"]["steps"] == 1
    assert set(runs["embedded"]["fields"]) == {"rollout_s", "train_s", "sync_s"}
    assert {f"train/{phase}" for phase in STEP_PHASES} <= set(runs["skyrl"]["step_records"][0])


def test_planner(tmp_path):
    out = tmp_path / "planner.json"
    planner.main(["--cases", "5", "--pack-cases", "3", "--large", "16", "--out", str(out)])
    report = read_json(out)
    assert report["small_cases"] == 5 and report["packs"]["cases"] == 3 and len(report["large"]) == 1


def test_common_writes_a_random_checkpoint(tmp_path, micro_model_dir):
    common.main(["--shape", "tiny", "--tokenizer-from", str(micro_model_dir), "--out", str(tmp_path / "model")])
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "model" / "model.safetensors").is_file()


@pytest.mark.skipif(common.DEVICE == "cuda", reason="a CUDA device runs the kernels")
def test_without_cuda_or_the_interpreter_a_kernel_benchmark_says_what_to_do(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for module in (attention, kernels, qkv_rope):
        with pytest.raises(SystemExit) as raised:
            module.main(["--smoke", "--out", str(tmp_path)])
        assert raised.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "TRITON_INTERPRET=1" in err
    assert not any(tmp_path.iterdir())
