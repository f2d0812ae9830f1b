"""clora.mode=serial on the GPU: each tenant's group of services plans its memory on a GPU the previous group has
given back (its KV pool of most of the GPU included), so every tenant runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_each_serial_group_plans_on_a_gpu_the_previous_one_gave_back(tmp_path: Path) -> None:
    from skyrl_clora.main import main

    assert main(["+tenants=2", "clora.mode=serial", "clora.progress=false", f"clora.output_dir={tmp_path}",
                 "trainer.max_training_steps=1", "clora.device=cuda"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["status"] for row in summary["per_tenant"]] == ["ok", "ok"]
    assert torch.cuda.memory_allocated() < 2 * 2**30  # nothing of the two KV pools is left
