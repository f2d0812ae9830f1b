"""The embedded default base model: a tiny Qwen3 pre-trained here, at first use, on a recipe's synthetic episodes.

The episodes come from the recipe named by ``model.corpus`` (a
:class:`~skyrl_clora.recipes.plugin.PretrainingCorpus`), tokenized exactly as SkyRL's generator assembles
episodes (`tokenizer.episode_token_ids`); the loss is on assistant tokens only. The episodes are deliberately
imperfect, so that RL has something to fix: each solves its task the way RL should learn to with probability
``solve_rate`` (default 0.35) and fails plausibly otherwise.

Training runs in two phases over the same tasks: a skill phase whose episodes solve their task with
probability ``skill_solve_rate`` (so most of the data teaches the skill), then ``prior_steps`` steps at
``solve_rate``, which set the decision prior the RL run starts from.

With the default corpus (``gsm8k``: use the calculator, copy its result into ``final_answer``; otherwise guess)
the pre-trained model answers right about as often as it calls the calculator, and nearly always when it does
(``python scripts/build_tiny_base.py`` measures both: RESULTS.md, CPU default run). GRPO only has to raise the
probability of one token (the tool name at the start of the first assistant turn) to lift accuracy towards the
calculator's.

Cost: the default settings' 600 pre-training steps take minutes on 2 CPU cores (README, The two commands), much
longer when other processes compete for the cores.

The model is cached on disk in HF format (config.json, model.safetensors, generation_config.json,
tokenizer files, recipe.json) under ``${SKYRL_CLORA_CACHE:-~/.cache/skyrl-clora}/models/tiny-qwen3-<hash>``
where the hash covers every setting of `TinyBaseRecipe`. A build writes into a temporary directory and
renames it into place, under a file lock, so a crashed build never leaves a partial model behind.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from skyrl_clora.recipes.plugin import CorpusSettings, Episode, load_corpus
from skyrl_clora.tiny_base.tokenizer import BASE_CONVERSATION, episode_token_ids, train_tokenizer

logger = logging.getLogger(__name__)

RECIPE_VERSION = 1
"""Bump when trace rendering or training code changes what a given recipe produces (new cache key)."""


@dataclass(frozen=True)
class TinyBaseRecipe:
    """Every setting that determines the tiny base model (all of it goes into the cache key).

    Corpus: the pre-training episodes of recipe `corpus` (a :class:`~skyrl_clora.recipes.plugin.PretrainingCorpus`).
    Model: a Qwen3 with `num_layers` layers of width `hidden_size`, `num_heads` query heads and
    `num_kv_heads` key/value heads of size `head_dim`, tied embeddings, fp32.
    Data: `num_traces` tasks, a fraction `hard_fraction` of them from the "hard" variant, rendered
    as episodes twice: solved with probability `skill_solve_rate` (skill phase) and with
    probability `solve_rate` (prior phase, the last `prior_steps` steps).
    Training: `steps` AdamW steps of `batch_size` episodes, peak `lr` with linear warm-up over
    `warmup_steps` and cosine decay to 10%.
    """

    corpus: str
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 1024
    vocab_size: int = 1024
    num_traces: int = 4000
    hard_fraction: float = 0.3
    solve_rate: float = 0.35
    skill_solve_rate: float = 0.9
    prior_steps: int = 100
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if not all(0.0 <= r <= 1.0 for r in (self.solve_rate, self.skill_solve_rate, self.hard_fraction)):
            raise ValueError("solve_rate, skill_solve_rate and hard_fraction must be in [0, 1]")
        if not 0 <= self.prior_steps <= self.steps:
            raise ValueError(f"prior_steps must be in [0, steps={self.steps}], got {self.prior_steps}")
        if min(self.num_traces, self.steps, self.batch_size, self.num_layers) < 1:
            raise ValueError("num_traces, steps, batch_size and num_layers must be >= 1")

    def cache_key(self) -> str:
        """12 hex digits of the sha256 of the settings and `RECIPE_VERSION`."""
        payload = json.dumps({"version": RECIPE_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    """``$SKYRL_CLORA_CACHE`` or ``~/.cache/skyrl-clora``."""
    return Path(os.environ.get("SKYRL_CLORA_CACHE") or Path.home() / ".cache" / "skyrl-clora")


def pretraining_episodes(recipe: TinyBaseRecipe, solve_rate: float) -> list[Episode]:
    """`recipe.num_traces` episodes of `recipe.corpus`'s pre-training corpus, each solving its task with
    probability `solve_rate` (see :class:`~skyrl_clora.recipes.plugin.PretrainingCorpus`)."""
    settings = CorpusSettings(count=recipe.num_traces, hard_fraction=recipe.hard_fraction, seed=recipe.seed)
    return load_corpus(recipe.corpus).pretraining_episodes(settings, solve_rate)


def build_tokenizer(episodes: list[Episode], vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains the tokenizer on the episodes' text (roles and contents) plus SkyRL's base conversation."""
    corpus = [f"{m['role']}\n{m['content']}" for m in BASE_CONVERSATION] * 2
    for prompt, turns in episodes:
        corpus += [f"{m['role']}\n{m['content']}" for m in prompt]
        for text, observations in turns:
            corpus.append(f"assistant\n{text}")
            corpus += [f"user\n{m['content']}" for m in observations]
    return train_tokenizer(corpus, vocab_size)


def make_model(recipe: TinyBaseRecipe, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """A randomly initialised fp32 Qwen3ForCausalLM sized by `recipe`, special ids from `tokenizer`."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    return Qwen3ForCausalLM(config).to(torch.float32)


def _lr_factor(step: int, recipe: TinyBaseRecipe) -> float:
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def pretrain(model: Qwen3ForCausalLM, skill: list[tuple[list[int], list[int]]],
             prior: list[tuple[list[int], list[int]]], recipe: TinyBaseRecipe, pad_id: int) -> list[float]:
    """Trains `model` in place on ``(ids, loss mask)`` sequences; returns the loss of every step.

    Steps ``< recipe.steps - recipe.prior_steps`` draw from `skill`, the rest from `prior`. Each step
    draws `recipe.batch_size` sequences (seeded), right-pads them to the batch's longest length L,
    and minimises the mean next-token cross-entropy over positions whose target has mask 1.
    """
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98),
                                  weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, recipe))
    model.train()
    losses: list[float] = []
    start = time.monotonic()
    for step in range(recipe.steps):
        sequences = skill if step < recipe.steps - recipe.prior_steps else prior
        picks = torch.randint(len(sequences), (recipe.batch_size,), generator=generator).tolist()
        length = max(len(sequences[i][0]) for i in picks)
        ids = torch.full((len(picks), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(picks), length), dtype=torch.long)
        attention = torch.zeros((len(picks), length), dtype=torch.long)
        for row, i in enumerate(picks):
            seq_ids, seq_mask = sequences[i]
            ids[row, : len(seq_ids)] = torch.tensor(seq_ids)
            mask[row, : len(seq_ids)] = torch.tensor(seq_mask)
            attention[row, : len(seq_ids)] = 1
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # [B, L-1, V]
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # [B, L-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % max(1, recipe.steps // 10) == 0 or step + 1 == recipe.steps:
            logger.info("tiny base pre-training: step %d/%d loss %.4f (%.0fs)", step + 1, recipe.steps,
                        loss.item(), time.monotonic() - start)
    model.eval()
    return losses


def build_tiny_base(out_dir: Path, recipe: TinyBaseRecipe) -> dict[str, Any]:
    """Builds tokenizer and model from scratch and saves them in HF format into `out_dir`.

    Returns the build record also written to ``out_dir/recipe.json``: the recipe, the cache key,
    ``train_seconds``, ``num_params``, ``first_loss``/``final_loss`` (means over the first/last 10% of steps).
    """
    start = time.monotonic()
    skill_episodes = pretraining_episodes(recipe, recipe.skill_solve_rate)
    prior_episodes = pretraining_episodes(recipe, recipe.solve_rate)
    tokenizer = build_tokenizer(skill_episodes + prior_episodes, recipe.vocab_size)
    skill = [episode_token_ids(tokenizer, prompt, turns) for prompt, turns in skill_episodes]
    prior = [episode_token_ids(tokenizer, prompt, turns) for prompt, turns in prior_episodes]
    model = make_model(recipe, tokenizer)
    logger.info("tiny base: %d params, vocab %d, %d problems (mean %.0f tokens per trace)", model.num_parameters(),
                len(tokenizer), len(prior), sum(len(s[0]) for s in prior) / len(prior))
    losses = pretrain(model, skill, prior, recipe, tokenizer.pad_token_id)
    window = max(1, len(losses) // 10)
    record = {
        "recipe": dataclasses.asdict(recipe),
        "recipe_version": RECIPE_VERSION,
        "cache_key": recipe.cache_key(),
        "train_seconds": round(time.monotonic() - start, 2),
        "num_params": model.num_parameters(),
        "first_loss": sum(losses[:window]) / window,
        "final_loss": sum(losses[-window:]) / window,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "recipe.json").write_text(json.dumps(record, indent=2))
    return record


def tiny_base_path(cache_root: Path | None, recipe: TinyBaseRecipe) -> Path:
    """Where the model of `recipe` is (or will be) cached: ``<cache_root or default_cache_root()>/models/tiny-qwen3-<key>``."""
    return (cache_root or default_cache_root()) / "models" / f"tiny-qwen3-{recipe.cache_key()}"


def ensure_tiny_base(cache_root: Path | None, recipe: TinyBaseRecipe, force: bool = False) -> Path:
    """Returns the cached tiny base model's directory, pre-training it first if it is missing (or `force`).

    Builds run under an exclusive lock file next to the model directory, so concurrent callers wait
    for one build instead of racing; the model is written into ``.tmp-<name>-<pid>`` and renamed into
    place only when complete, and leftover temporary directories of crashed builds are removed.
    """
    final = tiny_base_path(cache_root, recipe)
    if final.is_dir() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir() and not force:
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        logger.info("pre-training the tiny base model into %s (first use; a few minutes on 2 CPU cores)", final)
        try:
            record = build_tiny_base(tmp, recipe)
            if final.is_dir():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("tiny base ready in %.0fs (loss %.3f -> %.3f): %s", record["train_seconds"],
                    record["first_loss"], record["final_loss"], final)
    return final
