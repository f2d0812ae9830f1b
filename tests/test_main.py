"""skyrl_clora.main, the command line: ``--help`` prints the usage with the config groups and settable keys; bad
input is one ``error:`` line per problem and exit 2, before the run starts; a run's exit status says whether no
tenant, some or every tenant failed, or which signal stopped it (the run itself is :mod:`skyrl_clora.run_shell`'s,
stood in for here)."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import skyrl_clora.run_shell as run_shell
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.control.interrupts import STOP
from skyrl_clora.main import main


def test_help_prints_the_usage_groups_and_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m skyrl_clora.main [OVERRIDE ...]")
    assert "{" not in out.split("Tenants:")[0], "the usage's placeholders are filled"
    for expected in ("backend:", "clora.output_dir", "trainer.policy.optimizer_config.lr", "Exit status: 0"):
        assert expected in out, expected


def test_bad_input_is_one_error_line_per_problem_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def refused(argv: list[str]) -> Any:
        raise ConfigError("unknown key clora.bogus\ntrainer.seed must be an int")

    monkeypatch.setattr(run_shell, "prepare", refused)
    assert main(["clora.bogus=1"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: unknown key clora.bogus",
                                                    "error: trainer.seed must be an int"]


def _finished(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, statuses: list[str],
              stop_with: int | None = None) -> None:
    """``prepare`` and ``run_pool`` stood in for: a run whose tenants end with ``statuses`` (after the signal
    ``stop_with``, when given, asked the run to stop)."""
    prepared = SimpleNamespace(run=SimpleNamespace(output_dir=tmp_path))

    def run_pool(given: Any) -> dict[str, Any]:
        assert given is prepared
        if stop_with is not None:
            STOP.request(stop_with)
        return {"per_tenant": [{"tenant": f"t{i}", "status": status} for i, status in enumerate(statuses)]}

    monkeypatch.setattr(run_shell, "prepare", lambda argv: prepared)
    monkeypatch.setattr(run_shell, "run_pool", run_pool)


@pytest.mark.parametrize(("statuses", "status", "says"), [
    (["ok", "ok", "stopped"], 0, None),
    (["ok", "failed", "failed"], 1, "error: 2 of 3 tenants failed (t1, t2); their errors are in "),
    (["failed", "failed"], 3, "error: 2 of 2 tenants failed (t0, t1)"),
])
def test_the_exit_status_says_how_many_tenants_failed(statuses: list[str], status: int, says: str | None,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _finished(monkeypatch, tmp_path, statuses)
    assert main([]) == status
    err = capsys.readouterr().err
    assert (says in err and str(tmp_path / "summary.json") in err) if says else err == ""


@pytest.mark.parametrize(("number", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_run_exits_128_plus_its_signal_and_says_how_to_resume(number: int, status: int, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    _finished(monkeypatch, tmp_path, ["stopped", "failed"], stop_with=number)
    assert main([]) == status
    assert f"[stop] stopped; the same command resumes the run in {tmp_path}" in capsys.readouterr().err


def test_a_refusal_once_started_is_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A refusal from inside the run (e.g. the memory plan's) is bad input too: one line, exit 2."""
    _finished(monkeypatch, tmp_path, [])

    def refused(prepared: Any) -> dict[str, Any]:
        raise ConfigError("the KV pool does not fit; lower sampler.kv_cache_fraction")

    monkeypatch.setattr(run_shell, "run_pool", refused)
    assert main([]) == 2
    assert capsys.readouterr().err == "error: the KV pool does not fit; lower sampler.kv_cache_fraction\n"
