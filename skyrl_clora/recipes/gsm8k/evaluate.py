"""The GSM8K recipe's evaluation of a base (or fine-tuned) model on the calculator task, without any RL machinery.

It plays full episodes with HF `generate` (sampling, KV cache) and the real `GSM8KCalcEnv`, and assembles
the token sequence of each episode the way SkyRL's generator does (generated ids including
``<|im_end|>``, then `observation_ids`), so what it measures is what RL's step 0 will see.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from skyrl_clora.recipes.gsm8k.env import GSM8KCalcEnv
from skyrl_clora.tiny_base.tokenizer import observation_ids, template_ids


@dataclass(frozen=True)
class EvalResult:
    """Outcome of `evaluate_policy` over `episodes` episodes (rates in [0, 1]; NaN when undefined)."""

    episodes: int
    accuracy: float
    calculator_rate: float
    accuracy_with_calculator: float
    accuracy_without_calculator: float
    malformed_rate: float
    mean_generated_tokens: float
    """Sampled tokens per episode, summed over its assistant turns (what the RL engine decodes)."""
    mean_episode_tokens: float
    """Prompt + generated + observation tokens per episode (the trainer's sequence length)."""
    seconds: float


def _rate(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else math.nan


@torch.no_grad()
def _sample(model: PreTrainedModel, prompts: list[list[int]], pad_id: int, eos_id: int, max_new_tokens: int,
            temperature: float) -> list[list[int]]:
    """Samples one continuation per prompt (left-padded batch); each ends at its first eos, inclusive."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids, attention_mask=attention, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
    )[:, width:].tolist()
    return [row[: row.index(eos_id) + 1] if eos_id in row else row for row in out]


def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    max_turns: int = 3,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
) -> EvalResult:
    """Plays one episode per dataset row (agentic format, see `problems.problem_to_row`) and scores it."""
    start = time.monotonic()
    torch.manual_seed(seed)
    envs = [GSM8KCalcEnv(None, {"reward_spec": row["reward_spec"], "max_turns": max_turns}) for row in rows]
    ids = [template_ids(tokenizer, env.init(row["prompt"])[0], add_generation_prompt=True)
           for env, row in zip(envs, rows)]
    generated = [0] * len(rows)
    active = list(range(len(rows)))
    while active:
        still_active = []
        for chunk_start in range(0, len(active), batch_size):
            chunk = active[chunk_start: chunk_start + batch_size]
            outputs = _sample(model, [ids[i] for i in chunk], tokenizer.pad_token_id, tokenizer.eos_token_id,
                              max_new_tokens, temperature)
            for i, out in zip(chunk, outputs):
                step = envs[i].step(tokenizer.decode(out, skip_special_tokens=True))
                generated[i] += len(out)
                ids[i] = ids[i] + out
                if not step["done"]:
                    ids[i] += observation_ids(tokenizer, step["observations"], is_done=False)
                    still_active.append(i)
        active = still_active
    metrics = [env.get_metrics() for env in envs]
    n = len(metrics)
    with_calc = [m for m in metrics if m["used_calculator"]]
    without_calc = [m for m in metrics if not m["used_calculator"]]
    return EvalResult(
        episodes=n,
        accuracy=_rate(sum(m["correct"] for m in metrics), n),
        calculator_rate=_rate(len(with_calc), n),
        accuracy_with_calculator=_rate(sum(m["correct"] for m in with_calc), len(with_calc)),
        accuracy_without_calculator=_rate(sum(m["correct"] for m in without_calc), len(without_calc)),
        malformed_rate=_rate(sum(m["malformed"] for m in metrics), n),
        mean_generated_tokens=_rate(sum(generated), n),
        mean_episode_tokens=_rate(sum(len(x) for x in ids), n),
        seconds=round(time.monotonic() - start, 2),
    )
