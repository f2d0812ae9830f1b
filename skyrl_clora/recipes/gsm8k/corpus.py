"""The GSM8K recipe's pre-training corpus for the tiny base model: synthetic calculator-task episodes.

Each episode is ``(prompt messages, turns)``, a turn being ``(assistant text, observations)``. The traces are
deliberately imperfect, so that RL has something to fix: with probability ``solve_rate`` the assistant calls
the calculator with the correct expression, then copies the result into ``final_answer``; otherwise it calls
``final_answer`` at once with a guess (a number from the question, or one near the answer, never the answer
itself). Problems come from the "pretrain" split, never from RL's train or test splits.
"""

from __future__ import annotations

import random

from skyrl_clora.recipes.gsm8k.problems import SYSTEM_PROMPT, Problem, generate_problems
from skyrl_clora.recipes.gsm8k.tools import CALCULATOR, FINAL_ANSWER, calculate, format_tool_call
from skyrl_clora.recipes.plugin import CorpusSettings, Episode, Turn


def _wrong_guess(problem: Problem, rng: random.Random) -> int:
    """A plausible but wrong answer: a number from the question, or one within ±50% of the answer."""
    numbers = [int(tok) for tok in problem.expression.replace("(", " ").replace(")", " ").translate(
        str.maketrans("+-*/", "    ")).split()]
    for _ in range(100):
        if rng.random() < 0.5:
            guess = rng.choice(numbers)
        else:
            spread = max(3, problem.answer // 2)
            guess = max(0, problem.answer + rng.randint(-spread, spread))
        if guess != problem.answer:
            return guess
    return problem.answer + 1


def trace_turns(problem: Problem, use_calculator: bool, rng: random.Random) -> list[Turn]:
    """The assistant turns of one synthetic episode: ``[(assistant text, observations), ...]``."""
    if not use_calculator:
        return [(format_tool_call(FINAL_ANSWER, {"answer": str(_wrong_guess(problem, rng))}), [])]
    result = calculate(problem.expression)
    return [
        (format_tool_call(CALCULATOR, {"expression": problem.expression}), [{"role": "tool", "content": result}]),
        (format_tool_call(FINAL_ANSWER, {"answer": result}), []),
    ]


def prompt_messages(question: str) -> list[dict[str, str]]:
    """The task's prompt: the short system prompt and the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def pretraining_episodes(settings: CorpusSettings, solve_rate: float) -> list[Episode]:
    """``settings.count`` episodes, a fraction ``settings.hard_fraction`` of them from the "hard" variant, each
    using the calculator with probability ``solve_rate`` (seeded by ``settings.seed`` and the rate)."""
    num_hard = round(settings.count * settings.hard_fraction)
    problems = generate_problems(settings.count - num_hard, settings.seed, "standard", "pretrain")
    problems += generate_problems(num_hard, settings.seed, "hard", "pretrain")
    random.Random(f"skyrl-clora-traces:{settings.seed}").shuffle(problems)
    rng = random.Random(f"skyrl-clora-traces:{settings.seed}:{solve_rate}")
    return [(prompt_messages(p.question), trace_turns(p, rng.random() < solve_rate, rng)) for p in problems]
