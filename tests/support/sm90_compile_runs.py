"""Runs ``tests/support/sm90_compile.py`` for the Hopper compile tests of the kernel modules
(``test_compiles_for_sm90`` in tests/kernels/attention/test_decode.py, test_prefill.py and
tests/kernels/lora/test_qkv_rope.py, each over the cases of its own module): in subprocesses (one per kernel, side
by side) with ``TRITON_INTERPRET`` removed from their environment, since the suite sets it (scripts/test.sh) and only
without it are the kernels ``JITFunction`` objects the compiler takes, and with a Triton cache of their own, so that
each run compiles from scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.sm90_compile import CASES

HELPER = Path(__file__).resolve().with_name("sm90_compile.py")


def cases_of(module: str) -> list[str]:
    """The names of the ``sm90_compile.CASES`` whose kernel is in ``module`` (a ``skyrl_clora.kernels`` module)."""
    return [name for name, case in CASES.items() if case.module == module]


def run_helper(names: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPER), *names], env=env, capture_output=True, text=True, timeout=600)


def compile_errors(names: list[str], cache_dir: Path) -> dict[str, str | None]:
    """Each named case's compile error (None: it compiled), from runs of the helper side by side, one per kernel,
    with the Triton cache ``cache_dir``."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)  # the helper imports what this process does
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    by_kernel: dict[str, list[str]] = {}
    for name in names:
        by_kernel.setdefault(CASES[name].kernel, []).append(name)
    with ThreadPoolExecutor(len(by_kernel)) as pool:
        runs = list(pool.map(lambda kernel_names: run_helper(kernel_names, env), by_kernel.values()))
    errors: dict[str, str | None] = {}
    for run in runs:
        for line in run.stdout.splitlines():
            if line.startswith('{"case"'):
                report = json.loads(line)
                errors[report["case"]] = report["error"]
    missing = sorted(set(names) - set(errors))
    outputs = "\n".join(f"exit {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}" for run in runs)
    assert not missing, f"{HELPER.name} did not report {missing}:\n{outputs}"
    return errors


def sm90_compile_test(module: str) -> Callable[..., None]:
    """The test that each case of ``module`` (a ``skyrl_clora.kernels`` module, :func:`cases_of`) compiles for sm_90,
    to bind as ``test_compiles_for_sm90`` in that module's test file: parametrized by case, marked ``triton``; the
    first case run compiles all of them, from scratch (:func:`compile_errors`), and each case reads its own error."""
    cases = cases_of(module)
    errors: dict[str, str | None] = {}

    @pytest.mark.triton
    @pytest.mark.parametrize("case", cases)
    def test_compiles_for_sm90(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        if not errors:
            errors.update(compile_errors(cases, tmp_path_factory.mktemp("triton-cache")))
        assert errors[case] is None, f"{case} does not compile for sm_90:\n{errors[case]}"

    return test_compiles_for_sm90
