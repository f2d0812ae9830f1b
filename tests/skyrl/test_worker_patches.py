"""The upstream patches in integration/patches, checked against the installed SkyRL 0.4.0, and their run-time forms
in skyrl_clora.skyrl.

- Every patch applies (``git apply --check``) to a copy of the installed ``skyrl`` package laid out as SkyRL's
  repository (``skyrl/`` at the root), the layout the patches are written for.
- The patches' own upstream-style CPU tests (the ``tests/`` files they add) pass on a patched copy and fail on an
  unpatched one, except the guards of behaviour a patch must keep, which pass on both. Both runs are pytest
  subprocesses (run at the same time) with the copy first on ``PYTHONPATH``; their ``conftest.py`` stubs the
  GPU-only packages SkyRL's Megatron/FSDP worker modules import (``gpu_only_stubs``), so the tests of those real
  worker classes run here instead of being skipped.
- Run-time forms: ``with_per_tenant_lora_sync`` on SkyRL's real Megatron and FSDP worker classes
  (``worker_patches_on_skyrl_workers.py``, in the unpatched run's subprocess, since it needs the same stubs),
  ``with_salt_gated_lora_sync`` on the real ``WorkerDispatch``, and the tenant views, here.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from unittest.mock import AsyncMock, MagicMock, patch

import pytest
import skyrl
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch
from skyrl.env_vars import SKYRL_GENERATE_CONCURRENCY_PER_ENGINE
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.generators.utils import build_vllm_cache_salt

from skyrl_clora.backends.skyrl.tenant_client import tenant_views
from skyrl_clora.skyrl.worker_patches import with_per_tenant_lora_sync, with_salt_gated_lora_sync

HERE = Path(__file__).resolve().parent
PATCH_DIR = HERE.parents[1] / "integration" / "patches"
PATCHES = sorted(PATCH_DIR.glob("*.patch"))
SALT_PATCH = PATCH_DIR / "0001-per-adapter-cache-salt-and-prefix-cache-reset.patch"
SEED_PATCH = PATCH_DIR / "0002-megatron-seeded-lora-adapters.patch"
API_KEY_PATCH = PATCH_DIR / "0004-remote-inference-client-api-key.patch"
FSDP_STORE_PATCH = PATCH_DIR / "0005-fsdp-multi-lora-adapter-store.patch"
MEGATRON_CKPT_PATCH = PATCH_DIR / "0006-megatron-adapter-store-checkpoints.patch"
TINKER_PATCH = PATCH_DIR / "0007-tinker-pluggable-backends.patch"  # tested by tests/tinker/test_compat.py
BESIDE_PATCH = PATCH_DIR / "0008-tinker-samples-beside-blocking-ops.patch"  # run-time form: tests/tinker/test_engine_main.py
LOOKS_PATCH = PATCH_DIR / "0009-tinker-engine-loop-looks-on-commits.patch"  # run-time form: the same
RUNTIME_CHECKS = "worker_patches_on_skyrl_workers.py"

# The patch's tests that pass without it too: they guard what it must keep (single-model salts, duck-typed
# clients, the reset for Tinker's unsalted samples and for adapters without salted requests, no credentials sent
# by a client built without a key, no adapter store set up for a policy without LoRA).
COMPAT_GUARDS = {
    "test_adapter_cache_salt.py::test_single_model_salt_follows_every_sync",
    "test_adapter_cache_salt.py::test_clients_without_adapter_versions_keep_the_global_version",
    "test_adapter_sync_prefix_cache_reset.py::test_dispatch_keeps_the_reset_for_tinker_samples",
    "test_adapter_sync_prefix_cache_reset.py::test_dispatch_keeps_the_reset_without_evidence_of_salting",
    "test_megatron_adapter_seed.py::test_without_a_seed_the_adapter_is_the_pristine_copy",
    "test_megatron_adapter_seed.py::test_dispatch_without_a_seed_sends_none",
    "test_remote_client_api_key.py::test_without_a_key_no_authorization_header_is_sent",
    "test_fsdp_adapter_store.py::test_swapping_without_an_adapter_store_is_a_no_op",
    "test_fsdp_adapter_store.py::test_the_tinker_backend_sets_up_no_adapter_store_without_lora",
}

CONFTEST = """import pathlib, skyrl, gpu_only_stubs
gpu_only_stubs.install()
assert pathlib.Path(skyrl.__file__).resolve().is_relative_to(pathlib.Path(__file__).resolve().parent), skyrl.__file__
"""


def _skyrl_checkout(root: Path) -> Path:
    """The installed ``skyrl`` package copied to ``root/skyrl``."""
    shutil.copytree(Path(skyrl.__file__).resolve().parent, root / "skyrl", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _git_apply(root: Path, patch_file: Path, *options: str) -> None:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}  # root is no repository's subfolder
    result = subprocess.run(["git", "apply", *options, str(patch_file)], cwd=root, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{patch_file.name} does not apply: {result.stderr}"


def _start_pytest(root: Path, *paths: str) -> tuple[subprocess.Popen, Path]:
    shutil.copy(HERE / "gpu_only_stubs.py", root)
    (root / "conftest.py").write_text(CONFTEST)
    report = root / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                                *paths], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, report


def _outcomes(process: subprocess.Popen, report: Path) -> dict[str, str]:
    """``{"<file>::<test>": "passed" | "failed" | "error" | "skipped"}`` of a finished run."""
    output, _ = process.communicate(timeout=300)
    assert report.exists(), output[-3000:]
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes[f"{case.get('classname').rsplit('.', 1)[-1]}.py::{case.get('name')}"] = outcome.replace("failure",
                                                                                                          "failed")
    return outcomes


@pytest.fixture(scope="module")
def patch_test_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    patched = _skyrl_checkout(tmp_path_factory.mktemp("patched"))
    unpatched = _skyrl_checkout(tmp_path_factory.mktemp("unpatched"))
    for patch_file in PATCHES:  # in order: each applies on top of the ones before, and alone (see below)
        _git_apply(patched, patch_file)
        _git_apply(unpatched, patch_file, "--include=tests/*")
    shutil.copy(HERE / RUNTIME_CHECKS, unpatched)
    runs = {"patched": _start_pytest(patched, "tests"), "unpatched": _start_pytest(unpatched, "tests", RUNTIME_CHECKS)}
    return {name: _outcomes(*run) for name, run in runs.items()}


def test_every_patch_applies_to_the_installed_skyrl(tmp_path: Path) -> None:
    assert skyrl.__version__ == "0.4.0"
    assert PATCHES == [SALT_PATCH, SEED_PATCH, API_KEY_PATCH, FSDP_STORE_PATCH, MEGATRON_CKPT_PATCH, TINKER_PATCH,
                       BESIDE_PATCH, LOOKS_PATCH]
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = _skyrl_checkout(tmp_path)
    for patch_file in PATCHES:
        _git_apply(root, patch_file, "--check")


def test_the_patch_tests_pass_on_the_patched_skyrl(patch_test_runs: dict[str, dict[str, str]]) -> None:
    outcomes = patch_test_runs["patched"]
    assert len(outcomes) >= 20
    assert {name for name, outcome in outcomes.items() if outcome != "passed"} == set()  # none failed or skipped


def test_the_patch_tests_fail_on_the_unpatched_skyrl(patch_test_runs: dict[str, dict[str, str]]) -> None:
    outcomes = {name: outcome for name, outcome in patch_test_runs["unpatched"].items()
                if not name.startswith(RUNTIME_CHECKS)}
    assert outcomes.keys() == patch_test_runs["patched"].keys()
    assert {name for name, outcome in outcomes.items() if outcome == "passed"} == COMPAT_GUARDS
    assert {outcome for name, outcome in outcomes.items() if name not in COMPAT_GUARDS} == {"failed"}


def test_the_worker_form_on_skyrl_megatron_and_fsdp_workers(patch_test_runs: dict[str, dict[str, str]]) -> None:
    outcomes = {name: outcome for name, outcome in patch_test_runs["unpatched"].items()
                if name.startswith(RUNTIME_CHECKS)}
    assert len(outcomes) == 12
    assert set(outcomes.values()) == {"passed"}, outcomes


def _shared_client() -> RemoteInferenceClient:
    return RemoteInferenceClient(proxy_url="http://127.0.0.1:1", server_urls=["http://127.0.0.1:1"],
                                 data_parallel_size=1, model_name="base")


def _stub_generation(view) -> None:
    view._generate_single = AsyncMock(return_value={"stop_reason": "stop", "response_ids": [7],
                                                    "response_logprobs": None, "routed_experts": None})
    view.detokenize = AsyncMock(return_value=["x"])


def _generate(view, cache_salt: str | None) -> None:
    batch = {"prompt_token_ids": [[1, 2]], "sampling_params": {"max_tokens": 4}, "cache_salt": cache_salt}
    asyncio.run(view.generate(batch, model=view.tenant))


def _broadcast_kwargs(dispatch_cls: type, view, model_id: str | None) -> dict:
    """The worker-call kwargs of ``dispatch_cls._broadcast_to_inference_engines`` (SkyRL's real method body)."""
    dispatch = dispatch_cls.__new__(dispatch_cls)
    dispatch.cfg = SkyRLTrainConfig()
    dispatch._actor_groups = {"policy": MagicMock()}
    with patch("skyrl.backends.skyrl_train.workers.worker_dispatch.ray"), patch("skyrl_clora.skyrl.worker_patches.ray"):
        dispatch._broadcast_to_inference_engines(view, model_id=model_id)
    call = dispatch._actor_groups["policy"].async_run_ray_method.call_args
    assert call.args[:2] == ("pass_through", "broadcast_to_inference_engines")
    return call.kwargs


def test_a_salted_tenant_sync_tells_the_worker_so() -> None:
    """Run-time form of the dispatch half: the flag goes out only when every request of the tenant was salted."""
    views = tenant_views(_shared_client(), ["a", "b", "c"])
    for view in views.values():
        _stub_generation(view)
    gated = with_salt_gated_lora_sync(WorkerDispatch)
    _generate(views["a"], "a:0")
    _generate(views["b"], "b:0")
    _generate(views["b"], None)
    views["c"]._render_for_sample = AsyncMock(return_value=([1, 2], None))
    views["c"]._post = AsyncMock(return_value={"choices": []})
    asyncio.run(views["c"].sample({"json": {"prompt": {"chunks": []}, "num_samples": 1}}))  # Tinker: unsalted

    assert _broadcast_kwargs(gated, views["a"], "a") == {"model_id": "a", "prefix_cache_salted": True}
    assert _broadcast_kwargs(gated, views["b"], "b") == {"model_id": "b"}
    assert _broadcast_kwargs(gated, views["c"], "c") == {"model_id": "c"}
    assert _broadcast_kwargs(gated, tenant_views(_shared_client(), ["d"])["d"], "d") == {"model_id": "d"}  # no request
    assert _broadcast_kwargs(WorkerDispatch, views["a"], "a") == {"model_id": "a"}  # the stock dispatch never sends it
    with pytest.raises(TypeError, match="does not match patch 0001"):
        with_per_tenant_lora_sync(object)
    with pytest.raises(TypeError, match="does not match patch 0001"):
        with_salt_gated_lora_sync(object)


def test_a_view_answers_the_patched_dispatch_and_generator() -> None:
    """The patched SkyRL calls ``increment_weight_version(model_id)`` and ``weight_version_for(model)``."""
    view = tenant_views(_shared_client(), ["a"])["a"]
    view.increment_weight_version()
    view.increment_weight_version("a")
    assert view.weight_version == view.weight_version_for("a") == 1
    with pytest.raises(ValueError, match="cannot count a sync of 'b'"):
        view.increment_weight_version("b")


def test_a_global_version_bump_leaves_tenant_salts_alone() -> None:
    shared = _shared_client()
    views = tenant_views(shared, ["a", "b"], max_in_flight=3)
    shared.increment_weight_version()  # what WorkerDispatch.save_weights_for_sampler does after any adapter's sync
    assert views["a"].weight_version == views["b"].weight_version == -1  # no adapter loaded yet
    for view in views.values():
        view.increment_weight_version()  # each tenant's first sync (its version 0)
    views["a"].increment_weight_version()  # the next sync of tenant a
    assert shared.weight_version == 1
    assert build_vllm_cache_salt(views["a"].weight_version, "a") == "a:1"
    assert build_vllm_cache_salt(views["b"].weight_version, "b") == "b:0"
    assert views["a"].max_in_flight == views["b"].max_in_flight == 3
    assert tenant_views(shared, ["a", "b"])["a"].max_in_flight == max(1, SKYRL_GENERATE_CONCURRENCY_PER_ENGINE // 2)


def test_a_tenant_view_refuses_a_generate_batch_without_sampling_params() -> None:
    """The stock client would send {} and vLLM would stop after 16 tokens (a guard kept in the plugin)."""
    view = tenant_views(_shared_client(), ["tenant-a"])["tenant-a"]
    with pytest.raises(ValueError, match="needs input_batch\\['sampling_params'\\]"):
        asyncio.run(view.generate({"prompt_token_ids": [[1, 2, 3]]}))
    assert not view.prefix_cache_salted("tenant-a")
