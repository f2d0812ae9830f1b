"""The SkyRL GSM8K recipe's pre-training corpus for the tiny base model: single-turn answers to ``easy``
problems (one-digit sums and differences the model can know by heart), so that what RL has to fix is the
answer's format, as the agentic corpus leaves the calculator call to fix.

With probability ``solve_rate`` the answer is SkyRL's format, ``"<a>+<b> = <answer>\\n#### <answer>"`` (reward 1
from skyrl-gym's ``gsm8k`` env); otherwise ``"The answer is <answer>."``, right but without ``####`` (reward 0).
Problems come from the "pretrain" split, never from RL's train or test splits.
"""

from __future__ import annotations

import random

from skyrl_clora.recipes.gsm8k.problems import Problem, generate_problems
from skyrl_clora.recipes.plugin import CorpusSettings, Episode
from skyrl_clora.recipes.skyrl_gsm8k.data import user_message

VARIANT = "easy"


def answer_text(problem: Problem, in_format: bool) -> str:
    """The assistant's answer: SkyRL's ``####`` format when ``in_format``, else a plain sentence."""
    if in_format:
        return f"{problem.expression} = {problem.answer}\n#### {problem.answer}"
    return f"The answer is {problem.answer}."


def pretraining_episodes(settings: CorpusSettings, solve_rate: float) -> list[Episode]:
    """``settings.count`` single-turn episodes of ``easy`` problems (``settings.hard_fraction`` unused: one
    variant), each answering in SkyRL's format with probability ``solve_rate`` (seeded by ``settings.seed``)."""
    problems = generate_problems(settings.count, settings.seed, VARIANT, "pretrain")
    rng = random.Random(f"skyrl-clora-skyrl-gsm8k:{settings.seed}:{solve_rate}")
    return [([{"role": "user", "content": user_message(p.question)}], [(answer_text(p, rng.random() < solve_rate), [])])
            for p in problems]
