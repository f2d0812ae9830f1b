"""The ``trainer`` fixture of the tests that drive the swap-mode trainer of ``transport.swap_trainer`` (one slot,
tenants A of rank 8 and B of rank 16): ``trainer/test_trainer.py`` and ``trainer/test_adapter_store.py`` import it
by name, so pytest finds it in their module."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_clora.trainer.trainer import Trainer
from tests.support.transport import swap_trainer


@pytest.fixture
def trainer(micro_model_dir: Path) -> Trainer:
    return swap_trainer(micro_model_dir)
