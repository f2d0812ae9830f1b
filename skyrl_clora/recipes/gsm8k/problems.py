"""GSM8K-format word problems generated in code, and real GSM8K parquet files mapped to the agentic task.

A problem is a templated question with small integers whose answer needs 1-4 arithmetic operations,
for example::

    Tom has 23 apples. He buys 4 bags with 17 apples each. How many apples does he have now?
    expression "23+4*17", answer 91, answer text "23+4*17 = 91\\n#### 91"

Expressions list the numbers in the order the question mentions them, so a policy can copy them left
to right into its `calculator` call.

Task variants, selected by name (`VARIANTS`):

* ``standard``: 1-3 operations, operands up to ~30.
* ``hard``: 3-4 operations, operands up to ~200 (more and longer numbers to copy).
* ``easy``: one addition or subtraction of single-digit numbers (an answer a tiny model can know by heart, for
  tasks whose difficulty is the answer's format rather than its arithmetic).

Dataset rows follow SkyRL's prompt-dataset format (see `problem_to_row`); generation is deterministic
given ``(seed, variant, split, n)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from skyrl_clora.recipes.gsm8k.tools import evaluate_expression

SYSTEM_PROMPT = "Use the calculator tool, then call final_answer."
"""Short on purpose: every prompt token is prefilled by a CPU engine for every episode."""

DATA_SOURCE = "synthetic_gsm8k"
ENV_CLASS = "gsm8k_calc"
VARIANTS: tuple[str, ...] = ("standard", "hard", "easy")
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
"""Suffix SkyRL's gsm8k_dataset.py appends (after one space) to every question in the user message."""

_NAMES: tuple[tuple[str, str], ...] = (
    ("Tom", "he"), ("Ana", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"),
    ("Lily", "she"), ("Max", "he"), ("Eva", "she"), ("Leo", "he"), ("Zoe", "she"),
)
_ITEMS: tuple[str, ...] = (
    "apples", "pencils", "cookies", "stickers", "marbles", "books", "eggs", "coins", "cards", "shells",
)


@dataclass(frozen=True)
class _Template:
    """One question shape: `text` with `{a}`..`{e}` number slots, and the expression over those slots.

    `ranges[slot] = (low, high)` bounds each number (inclusive). Numbers are drawn uniformly and redrawn
    until the expression evaluates to a positive integer (so divisions come out exact).
    """

    text: str
    expression: str
    ranges: dict[str, tuple[int, int]]


_STANDARD: tuple[_Template, ...] = (
    _Template("{N} has {a} {I}. {P} buys {b} bags with {c} {I} each. How many {I} does {p} have now?",
              "a+b*c", {"a": (2, 30), "b": (2, 9), "c": (2, 20)}),
    _Template("{N} has {a} {I}. {P} gives away {b} {I}. How many {I} are left?",
              "a-b", {"a": (10, 60), "b": (2, 30)}),
    _Template("{N} buys {a} boxes of {I}. Each box holds {b} {I}. How many {I} does {p} buy?",
              "a*b", {"a": (2, 12), "b": (2, 25)}),
    _Template("{N} shares {a} {I} equally among {b} friends. How many {I} does each friend get?",
              "a/b", {"a": (4, 99), "b": (2, 9)}),
    _Template("{N} has {a} {I} and finds {b} more. Then {p} loses {c}. How many {I} does {p} have?",
              "a+b-c", {"a": (5, 40), "b": (2, 30), "c": (2, 20)}),
    _Template("A shop puts {a} {I} on each of {b} shelves. It sells {c} {I}. How many {I} are left?",
              "a*b-c", {"a": (3, 20), "b": (2, 9), "c": (2, 30)}),
    _Template("{N} picks {a} {I} in the morning and {b} in the afternoon. {P} packs them in bags of {c}. "
              "How many bags does {p} fill?",
              "(a+b)/c", {"a": (4, 40), "b": (4, 40), "c": (2, 9)}),
    _Template("{N} has {a} {I}. {P} buys {b} packs of {c} {I} and gives {d} to a friend. "
              "How many {I} does {p} have now?",
              "a+b*c-d", {"a": (2, 30), "b": (2, 6), "c": (2, 12), "d": (2, 20)}),
)

_HARD: tuple[_Template, ...] = (
    _Template("{N} has {a} {I}. {P} buys {b} packs of {c} {I} and gives {d} to a friend. "
              "How many {I} does {p} have now?",
              "a+b*c-d", {"a": (20, 200), "b": (3, 19), "c": (3, 40), "d": (10, 120)}),
    _Template("{N} buys {a} boxes with {b} {I} each and {c} bags with {d} {I} each. "
              "How many {I} does {p} buy in total?",
              "a*b+c*d", {"a": (3, 19), "b": (5, 60), "c": (3, 19), "d": (5, 60)}),
    _Template("A shop puts {a} {I} on each of {b} shelves and sells {c} of them. "
              "It packs the rest in bags of {d}. How many bags does it fill?",
              "(a*b-c)/d", {"a": (5, 40), "b": (3, 15), "c": (5, 90), "d": (2, 12)}),
    _Template("{N} has {a} {I} and finds {b} more. {P} gives {c} {I} to each of {d} friends. "
              "How many {I} are left?",
              "a+b-c*d", {"a": (40, 200), "b": (10, 150), "c": (3, 20), "d": (2, 9)}),
    _Template("{N} collects {a} {I} a day for {b} days, then {c} {I} a day for {d} days, and loses {e}. "
              "How many {I} does {p} have?",
              "a*b+c*d-e", {"a": (4, 40), "b": (3, 12), "c": (4, 40), "d": (3, 12), "e": (5, 90)}),
)

_EASY: tuple[_Template, ...] = (
    _Template("{N} has {a} {I} and finds {b} more. How many {I} does {p} have now?", "a+b", {"a": (1, 9), "b": (1, 9)}),
    _Template("{N} has {a} {I}. {P} gives away {b}. How many {I} are left?", "a-b", {"a": (5, 9), "b": (1, 4)}),
)

_TEMPLATES: dict[str, tuple[_Template, ...]] = {"standard": _STANDARD, "hard": _HARD, "easy": _EASY}


@dataclass(frozen=True)
class Problem:
    """A word problem: `question` text, ground-truth `expression` (numbers substituted), integer `answer`."""

    question: str
    expression: str
    answer: int

    @property
    def answer_text(self) -> str:
        """GSM8K-style solution text ending in ``#### <answer>``."""
        return f"{self.expression} = {self.answer}\n#### {self.answer}"


def _instantiate(template: _Template, rng: random.Random) -> Problem:
    """Draws numbers for `template` until its expression is a positive integer; fills names and items."""
    name, pronoun = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    for _ in range(10_000):
        numbers = {slot: rng.randint(low, high) for slot, (low, high) in template.ranges.items()}
        expression = "".join(str(numbers[ch]) if ch in numbers else ch for ch in template.expression)
        value = evaluate_expression(expression)
        if value.denominator == 1 and value > 0:
            question = template.text.format(N=name, P=pronoun.capitalize(), p=pronoun, I=item, **numbers)
            return Problem(question=question, expression=expression, answer=int(value))
    raise RuntimeError(f"no valid numbers found for template {template.expression!r}")


def generate_problems(n: int, seed: int = 0, variant: str = "standard", split: str = "train") -> list[Problem]:
    """Returns `n` problems of `variant`, a pure function of ``(n, seed, variant, split)``.

    Templates cycle in a seeded random order so every template appears about equally often. Different
    splits (or seeds) use independent random streams.
    """
    if variant not in _TEMPLATES:
        raise ValueError(f"unknown gsm8k task variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if n < 0:
        raise ValueError(f"number of problems must be >= 0, got {n}")
    rng = random.Random(f"skyrl-clora-gsm8k:{seed}:{variant}:{split}")
    templates = _TEMPLATES[variant]
    problems: list[Problem] = []
    while len(problems) < n:
        order = list(templates)
        rng.shuffle(order)
        problems.extend(_instantiate(t, rng) for t in order[: n - len(problems)])
    return problems


def problem_to_row(problem: Problem, split: str, index: int, data_source: str = DATA_SOURCE) -> dict[str, Any]:
    """One SkyRL prompt-dataset row for the agentic calculator task.

    Returns ``{"data_source", "prompt": [system, user], "env_class": "gsm8k_calc",
    "reward_spec": {"method": "rule", "ground_truth": str(answer)},
    "extra_info": {"split", "index", "answer", "question"}}``.
    """
    return {
        "data_source": data_source,
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem.question},
        ],
        "env_class": ENV_CLASS,
        "reward_spec": {"method": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "answer": problem.answer_text, "question": problem.question},
    }


def make_dataset_rows(n: int, seed: int = 0, variant: str = "standard", split: str = "train") -> list[dict[str, Any]]:
    """`n` dataset rows (see `problem_to_row`), deterministic given ``(n, seed, variant, split)``."""
    return [problem_to_row(p, split, i) for i, p in enumerate(generate_problems(n, seed, variant, split))]


def _question_from_gsm8k_row(row: dict[str, Any]) -> str:
    """The bare question of a SkyRL gsm8k row: ``extra_info.question`` or the user message minus the suffix."""
    extra_info = row.get("extra_info") or {}
    if extra_info.get("question"):
        return str(extra_info["question"])
    users = [m for m in row.get("prompt") or [] if m.get("role") == "user"]
    if not users:
        raise ValueError(f"gsm8k row {extra_info.get('index', '?')} has no user message and no extra_info.question")
    content = str(users[-1]["content"])
    return content.removesuffix(GSM8K_INSTRUCTION).rstrip()


def gsm8k_row_to_agentic(row: dict[str, Any], index: int) -> dict[str, Any]:
    """Maps one row of SkyRL's gsm8k_dataset.py parquet (env_class "gsm8k") to the calculator task's format.

    The question comes from ``extra_info["question"]`` when present, else from the user message with
    SkyRL's "Let's think step by step..." suffix stripped; the ground truth from ``reward_spec``.
    """
    reward_spec = row.get("reward_spec") or {}
    if reward_spec.get("ground_truth") is None:
        raise ValueError(f"gsm8k row {index} has no reward_spec.ground_truth")
    question = _question_from_gsm8k_row(row)
    extra_info = dict(row.get("extra_info") or {})
    split = str(extra_info.get("split", "train"))
    answer = str(extra_info.get("answer", f"#### {reward_spec['ground_truth']}"))
    return {
        "data_source": str(row.get("data_source", "openai/gsm8k")),
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ],
        "env_class": ENV_CLASS,
        "reward_spec": {"method": str(reward_spec.get("method", "rule")), "ground_truth": str(reward_spec["ground_truth"])},
        "extra_info": {"split": split, "index": int(extra_info.get("index", index)), "answer": answer,
                       "question": question},
    }


def load_gsm8k_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Reads a parquet file written by SkyRL's gsm8k_dataset.py and returns agentic-format rows."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"gsm8k parquet file not found: {path}")
    return [gsm8k_row_to_agentic(row, i) for i, row in enumerate(pq.read_table(path).to_pylist())]


def save_rows_parquet(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Writes dataset rows to a parquet file that SkyRL's PromptDataset (and `load_gsm8k_parquet`) read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path

