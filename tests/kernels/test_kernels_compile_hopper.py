"""Every GPU specialisation the engine launches of the kernels that read or write the K/V cache (``_qkv_rope_kernel``,
the decode attention partials, the prefill attention; ``sm90_compile.CASES``), with the cache in the model dtype
(bf16) and in fp8, compiles for sm_90 (Hopper): Triton's front end, its MLIR passes and the bundled ptxas, run on
the CPU. The interpreter that runs the other kernel tests skips that compiler, so these catch what only the GPU's
compiler rejects, e.g. a variable given another type in one branch of a runtime ``if``.

The compiles run in subprocesses of ``tests/support/sm90_compile.py`` (one per kernel, side by side) with ``TRITON_INTERPRET``
removed from their environment, since the suite sets it (scripts/test.sh) and only without it are the kernels
``JITFunction`` objects the compiler takes, and with a Triton cache of their own, so that each run compiles from
scratch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.sm90_compile import CASES

pytestmark = pytest.mark.triton
HELPER = Path(__file__).resolve().parents[1] / "support" / "sm90_compile.py"


def run_helper(names: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPER), *names], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compile_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Each case's compile error (None: it compiled), from runs of the helper side by side, one per kernel."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)  # the helper imports what this process does
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    by_kernel: dict[str, list[str]] = {}
    for name, case in CASES.items():
        by_kernel.setdefault(case.kernel, []).append(name)
    with ThreadPoolExecutor(len(by_kernel)) as pool:
        runs = list(pool.map(lambda names: run_helper(names, env), by_kernel.values()))
    errors: dict[str, str | None] = {}
    for run in runs:
        for line in run.stdout.splitlines():
            if line.startswith('{"case"'):
                report = json.loads(line)
                errors[report["case"]] = report["error"]
    missing = sorted(set(CASES) - set(errors))
    outputs = "\n".join(f"exit {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}" for run in runs)
    assert not missing, f"{HELPER.name} did not report {missing}:\n{outputs}"
    return errors


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_for_sm90(case: str, compile_errors: dict[str, str | None]) -> None:
    error = compile_errors[case]
    assert error is None, f"{case} does not compile for sm_90:\n{error}"
