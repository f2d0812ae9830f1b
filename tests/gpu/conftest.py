"""The GPU tests run under the process settings of a run (``backends.embedded.services.build_services`` sets them):
cuDNN's attention off, as the trainer's passes have it there."""

from __future__ import annotations

import pytest

from skyrl_clora.device.cuda_settings import avoid_cudnn_attention


@pytest.fixture(autouse=True, scope="session")
def _run_process_settings() -> None:
    avoid_cudnn_attention()
