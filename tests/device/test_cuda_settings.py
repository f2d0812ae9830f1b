"""Process-wide CUDA settings (:mod:`skyrl_clora.device.cuda_settings`), with CUDA's presence and the two torch
switches they flip recorded: cuDNN attention is turned off and the allocator's expandable segments turned on only
where CUDA is, the latter unless ``PYTORCH_CUDA_ALLOC_CONF`` already chooses."""

from __future__ import annotations

import pytest
import torch

from skyrl_clora.device.cuda_settings import avoid_cudnn_attention, use_expandable_segments


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """The calls of ``enable_cudnn_sdp`` and ``_set_allocator_settings``, which change nothing here."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda enabled: calls.append(("cudnn_sdp", enabled)))
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda text: calls.append(("allocator", text)))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    return calls


@pytest.mark.parametrize("cuda", [False, True])
def test_the_settings_apply_only_with_cuda(monkeypatch: pytest.MonkeyPatch, recorded: list, cuda: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    avoid_cudnn_attention()
    use_expandable_segments()
    assert recorded == ([("cudnn_sdp", False), ("allocator", "expandable_segments:True")] if cuda else [])


@pytest.mark.parametrize("conf, applied", [("expandable_segments:False", False), ("max_split_size_mb:64", True)])
def test_an_allocator_conf_that_chooses_is_kept(monkeypatch: pytest.MonkeyPatch, recorded: list, conf: str,
                                                applied: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    use_expandable_segments()
    assert recorded == ([("allocator", "expandable_segments:True")] if applied else [])
