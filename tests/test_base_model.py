"""skyrl_clora.base_model: the device a run's ``clora.device`` means and the dtype ``model.dtype`` means on it, the
checks of a model folder made before a run starts (a usable Hugging Face folder; a tokenizer with an eos token and a
chat template), the base model's folder (the user's, else the tiny base built on first use), its load and its
tokenizer."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import skyrl_clora.tiny_base.pretrain as pretrain
from skyrl_clora.base_model import (check_model_folder, checked_tokenizer, load_base_model, model_dtype, prompt_tokenizer,
                                    resolve_device, resolve_model_path)
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import compose_config
from skyrl_clora.config.schema import ConfigError, RunConfig


def _run(tmp_path: Path, *overrides: str) -> RunConfig:
    return build_run_config(compose_config([f"clora.output_dir={tmp_path / 'out'}", *overrides]))


@pytest.mark.parametrize(("device", "cuda_visible", "expected"), [
    ("cpu", True, "cpu"), ("auto", False, "cpu"), ("auto", True, "cuda"), ("cuda", True, "cuda"),
])
def test_the_device_of_clora_device(device: str, cuda_visible: bool, expected: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_visible)
    assert resolve_device(_run(tmp_path, f"clora.device={device}")) == torch.device(expected)


def test_cuda_without_a_visible_gpu_is_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device is visible; use clora.device=auto or cpu"):
        resolve_device(_run(tmp_path, "clora.device=cuda"))


def test_a_model_folder_is_checked_without_loading_its_weights(micro_model_dir: Path, tmp_path: Path) -> None:
    check_model_folder(str(micro_model_dir))
    config_only = tmp_path / "config-only"
    shutil.copytree(micro_model_dir, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    check_model_folder(str(config_only))  # no weights: the check reads only the config and the tokenizer
    with pytest.raises(ConfigError, match="is not a usable Hugging Face model folder .*point it at a causal-LM"):
        check_model_folder(str(tmp_path / "empty"))


def test_a_tokenizer_without_a_chat_template_is_refused(micro_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-template"
    shutil.copytree(micro_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = None
    for template_file in folder.glob("chat_template.*"):
        template_file.unlink()
    tokenizer.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).chat_template is None
    with pytest.raises(ConfigError, match="tokenizer needs an eos token and a chat template"):
        check_model_folder(str(folder))


def test_the_model_folder_is_the_users_else_the_tiny_base(micro_model_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, f"trainer.policy.model.path={micro_model_dir}")
    assert resolve_model_path(run) == str(micro_model_dir)
    assert prompt_tokenizer(run).get_vocab() == AutoTokenizer.from_pretrained(micro_model_dir).get_vocab()

    built: list[str] = []
    cache = tmp_path / "tiny-cache"

    def ensure_tiny_base(root: Path | None, recipe: pretrain.TinyBaseRecipe) -> Path:
        built.append(recipe.corpus)
        (cache / recipe.corpus).mkdir(parents=True, exist_ok=True)
        return cache / recipe.corpus

    monkeypatch.setattr(pretrain, "tiny_base_path", lambda root, recipe: cache / recipe.corpus)
    monkeypatch.setattr(pretrain, "ensure_tiny_base", ensure_tiny_base)
    tiny = dataclasses.replace(run, model_path=None)
    assert resolve_model_path(tiny) == str(cache / tiny.model_corpus)
    assert "[setup] pre-training the tiny base model" in capsys.readouterr().err, "the first use says it builds"
    assert resolve_model_path(tiny) == str(cache / tiny.model_corpus)
    assert "[setup]" not in capsys.readouterr().err, "a built tiny base is used as it is"
    assert built == [tiny.model_corpus] * 2


@pytest.mark.parametrize(("dtype", "device", "expected"), [
    ("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16), ("float16", "cpu", torch.float16),
    ("bfloat16", "cpu", torch.bfloat16), ("float32", "cuda", torch.float32),
])
def test_the_model_dtype_is_models_dtype_or_the_devices(dtype: str, device: str, expected: torch.dtype,
                                                        tmp_path: Path) -> None:
    assert model_dtype(_run(tmp_path, f"model.dtype={dtype}"), torch.device(device)) == expected


def test_the_base_model_loads_in_its_dtype_for_eval_with_a_checked_tokenizer(micro_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    model = load_base_model(_run(tmp_path, "model.dtype=bfloat16"), str(micro_model_dir), torch.device("cpu"))
    assert not model.training and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert checked_tokenizer(str(micro_model_dir)).chat_template is not None
