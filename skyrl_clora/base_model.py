"""The run's base model: its folder (the user's checkpoint or the tiny base, built on first use), the device it runs
on and its tokenizer; read by every backend and by the checks made before a run starts."""

from __future__ import annotations

import logging
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from skyrl_clora.config.schema import ConfigError, RunConfig

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype``'s names (``auto``: bfloat16 on a GPU, float32 on the CPU)."""


def resolve_device(run: RunConfig) -> torch.device:
    """The device of ``clora.device`` (``auto``: the GPU when one is visible, else the CPU); a :class:`ConfigError`
    for ``cuda`` without a visible GPU."""
    if run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("clora.device=cuda but no CUDA device is visible; use clora.device=auto or cpu")
    if run.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(run.device)


def check_model_folder(path: str) -> None:
    """A :class:`ConfigError` unless ``path`` holds a Hugging Face causal-LM config and a tokenizer with an eos
    token and a chat template (read without loading the weights)."""
    from transformers import AutoConfig

    hf_logging.set_verbosity_error()
    try:
        AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"trainer.policy.model.path={path} is not a usable Hugging Face model folder ({first}); point it at a "
                          "causal-LM checkpoint folder (config.json, weights, tokenizer)") from None
    _require_chat_tokenizer(tokenizer, path)


def model_dtype(run: RunConfig, device: torch.device) -> torch.dtype:
    """The base model's dtype on ``device``: ``model.dtype`` (``auto``: bfloat16 on a GPU, float32 on the CPU)."""
    if run.model_dtype != "auto":
        return MODEL_DTYPES[run.model_dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_base_model(run: RunConfig, path: str, device: torch.device) -> torch.nn.Module:
    """The causal LM in folder ``path`` in :func:`model_dtype` on ``device``, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(run, device)).to(device).eval()


def checked_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of folder ``path``; a :class:`ConfigError` unless it has an eos token and a chat template."""
    return _require_chat_tokenizer(AutoTokenizer.from_pretrained(path), path)


def _require_chat_tokenizer(tokenizer: PreTrainedTokenizerBase, path: str) -> PreTrainedTokenizerBase:
    if tokenizer.eos_token_id is None or tokenizer.chat_template is None:
        raise ConfigError(f"trainer.policy.model.path={path}: tokenizer needs an eos token and a chat template")
    return tokenizer


def resolve_model_path(run: RunConfig) -> str:
    """The base model folder: ``trainer.policy.model.path`` or the tiny pre-trained base (built and cached on first use)."""
    if run.model_path is not None:
        return run.model_path
    from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, ensure_tiny_base, tiny_base_path

    recipe = TinyBaseRecipe(corpus=run.model_corpus)
    if not tiny_base_path(None, recipe).is_dir():
        print(f"[setup] pre-training the tiny base model into {tiny_base_path(None, recipe)} (first use only; about "
              "5 minutes on 2 CPU cores; a progress line every 10% of its steps)", file=sys.stderr, flush=True)
        logging.getLogger("skyrl_clora.tiny_base").setLevel(logging.INFO)  # its progress lines, under WARNING's root
    return str(ensure_tiny_base(None, recipe))


def prompt_tokenizer(run: RunConfig) -> PreTrainedTokenizerBase:
    """The base model's tokenizer (the tiny base built first if needed), which SkyRL's prompt-length rule counts
    with (``recipes.plugin.drop_long_prompts``)."""
    return AutoTokenizer.from_pretrained(resolve_model_path(run))
