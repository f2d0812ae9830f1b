"""What a GPU-cluster test needs, as a module-level skip mark with the reason."""

from __future__ import annotations

import importlib.util

import pytest


def requires(gpus: int, modules: tuple[str, ...]) -> pytest.MarkDecorator:
    """Skips the module unless ``gpus`` CUDA devices and every top-level package of ``modules`` are present."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        return pytest.mark.skip(reason=f"needs {', '.join(missing)} (a GPU node with SkyRL's vLLM/Megatron extras)")
    import torch

    if torch.cuda.device_count() < gpus:
        return pytest.mark.skip(reason=f"needs {gpus} CUDA GPUs, {torch.cuda.device_count()} visible")
    return pytest.mark.skipif(False, reason="requirements present")
