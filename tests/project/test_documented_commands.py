"""Every command README.md, RESULTS.md and docs/ show for this project's own entry points runs as written, as far
as the CPU can check without running it: its arguments parse (``python -m benchmarks.<name>``, ``python -m
skyrl_clora.<name>``, ``python scripts/<name>.py``: the module's own argparse, stopped right after parsing), the run
configuration it gives composes and validates (``python -m skyrl_clora.main`` and ``bash scripts/run.sh``; the
``--override`` and ``--variant`` keys of the benchmarks, and the run overrides ``benchmarks.concurrency`` forwards),
and the test paths and scripts it names exist.

A command is an inline code span, or a line of a ```bash block, that starts with one of those entry points (after
``VAR=value`` assignments); ``;`` and ``&&`` separate commands, and an output redirection (`` > file``) is left
aside. ``$OUT`` stands for an output folder and ``"$@"`` for the user's own arguments; ``/tmp/`` and relative paths
are taken in a scratch folder, where the model folders and data files a command reads are made first (earlier
documented commands, or the device set-up, make them)."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import check_known_keys, compose_config
from skyrl_clora.main import main

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "RESULTS.md", "docs/gpu.md", "docs/config.md")
PROGRAM = re.compile(r"^(?:\w+=\S*\s+)*(?P<command>(?:python3?|bash)\s+.*)$")
OURS = re.compile(r"^(?:python3? -m (?:benchmarks|skyrl_clora|pytest)\b|python3? scripts/|bash scripts/)")


def documented_commands(text: str) -> list[str]:
    """The commands of a Markdown ``text`` for this project's entry points (see the module docstring), whitespace
    folded to single spaces."""
    bash_lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    commands = []
    for candidate in spans + [line.split(" #")[0].strip() for line in bash_lines]:
        for part in re.split(r"\s*(?:;|&&)\s*", candidate):
            match = PROGRAM.match(part.strip())
            if match and OURS.match(match.group("command")):
                commands.append(match.group("command"))
    return commands


def _cases() -> list[Any]:
    return [pytest.param(command, id=f"{doc}:{command[:90]}") for doc in DOCS
            for command in dict.fromkeys(documented_commands((ROOT / doc).read_text()))]


class Parsed(Exception):
    """Raised by the patched argparse once a command line parsed: the namespace and the arguments left over."""

    def __init__(self, namespace: argparse.Namespace, extra: list[str]) -> None:
        super().__init__("parsed")
        self.namespace, self.extra = namespace, extra


def _parse_only(target: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, as_path: bool) -> Parsed:
    """Runs module (or script) ``target`` as ``__main__`` with ``argv`` up to its argparse call; returns what parsed
    (one that parses no arguments runs to its end, and must then be given none)."""
    known = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN202 - argparse's signature
        namespace, extra = known(self, args, namespace)
        raise Parsed(namespace, extra)

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN202 - argparse's signature
        namespace, extra = known(self, args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise Parsed(namespace, [])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [target, *argv])
    try:
        if as_path:
            runpy.run_path(str(ROOT / target), run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except Parsed as parsed:
        return parsed
    assert not argv, f"{target} parses no arguments; the command gives it {argv}"
    return Parsed(argparse.Namespace(), [])


INPUT_KEYS = {"trainer.policy.model.path": "model", "data.train_data": "data", "data.val_data": "data"}


def _make_inputs(overrides: list[str], scratch: Path) -> None:
    """Makes in ``scratch`` the model folders (a ``config.json``) and data files that ``overrides`` name there."""
    for override in overrides:
        key, _, value = override.partition("=")
        kind = INPUT_KEYS.get(key.lstrip("+"))
        for path in (Path(item).resolve() for item in value.strip("[]").split(",") if kind and item):
            if path.is_relative_to(scratch):
                folder = path if kind == "model" else path.parent
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "config.json" if kind == "model" else path).touch()


def _check_run_overrides(overrides: list[str]) -> None:
    """The overrides compose into a run configuration that validates, as ``skyrl_clora.main`` reads them (the
    inputs they name in the working folder made first)."""
    _make_inputs(overrides, Path.cwd().resolve())
    cfg = compose_config(overrides)
    check_known_keys(cfg, overrides)
    build_run_config(cfg)


def _benchmark_overrides(parsed: Parsed) -> list[str]:
    """The run overrides a benchmark's command line carries (``--override``, ``--variant``, forwarded arguments)."""
    overrides = list(getattr(parsed.namespace, "override", None) or [])
    for variant in getattr(parsed.namespace, "variant", None) or []:
        overrides += variant.split(":", 1)[1].split(",")
    return overrides + parsed.extra


@pytest.mark.parametrize("command", _cases())
def test_a_documented_command_runs_as_written(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.chdir(tmp_path)  # the scratch folder; the project's modules import from its root (sys.path)
    written = command.replace("$OUT", str(tmp_path / "out")).replace("/tmp/", f"{tmp_path}/")
    words = [word for word in shlex.split(written.split(" > ")[0]) if word != "$@"]  # its output's redirection aside
    program, args = words[0], words[1:]
    if program == "bash":
        script, argv = args[0], args[1:]
        assert (ROOT / script).is_file(), f"{script} does not exist"
        if script == "scripts/run.sh":
            _check_run_overrides(argv)
        else:
            text = (ROOT / script).read_text()
            assert all(flag in text for flag in argv), f"{script} does not read {argv}"
        return
    if args[0] != "-m":
        parsed = _parse_only(args[0], args[1:], monkeypatch, as_path=True)
        assert not _benchmark_overrides(parsed)
        return
    module, argv = args[1], args[2:]
    if module == "pytest":
        paths = [arg.split("::")[0] for arg in argv if not arg.startswith("-")]
        assert paths and all((ROOT / path).exists() for path in paths), f"a test path of {argv} does not exist"
    elif module == "skyrl_clora.main":
        if "--help" in argv:
            assert main(argv) == 0
        else:
            _check_run_overrides(argv)
    else:
        parsed = _parse_only(module, argv, monkeypatch, as_path=False)
        overrides = _benchmark_overrides(parsed) if module.startswith("benchmarks.") else parsed.extra
        if overrides:
            _check_run_overrides(overrides)


def test_commands_are_found_in_spans_blocks_and_chains() -> None:
    text = ("Run `PYTHONPATH=x python3 -m benchmarks.e2e --out $OUT/a.json`; then `git log` and\n"
            "`python -m skyrl_clora.main\n+tenants=2; bash scripts/test.sh --fast`.\n"
            "```bash\nbash scripts/run.sh +tenants=8   # the main job\n```\n"
            "```\npython -m benchmarks.layout_not_a_command\n```\n")
    assert documented_commands(text) == ["python3 -m benchmarks.e2e --out $OUT/a.json",
                                         "python -m skyrl_clora.main +tenants=2", "bash scripts/test.sh --fast",
                                         "bash scripts/run.sh +tenants=8"]
