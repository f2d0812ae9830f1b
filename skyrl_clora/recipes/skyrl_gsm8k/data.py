"""SkyRL-format GSM8K rows: the columns SkyRL's ``examples/train/gsm8k/gsm8k_dataset.py`` writes, made from the
project's generated problems, and read back unchanged from any such parquet file.

A row is ``{"data_source", "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
"env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": "<answer>"},
"extra_info": {"split", "index", "answer", "question"}}``.

``python -m skyrl_clora.recipes.skyrl_gsm8k.data --output_dir ~/data/gsm8k`` writes ``train.parquet`` and
``validation.parquet`` as SkyRL's script does (no dataset hub needed).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from skyrl_clora.recipes.gsm8k.problems import GSM8K_INSTRUCTION, VARIANTS, Problem, generate_problems, save_rows_parquet
from skyrl_clora.recipes.plugin import load_skyrl_rows

ENV_CLASS = "gsm8k"
"""skyrl-gym's single-turn GSM8K environment (``skyrl_gym.envs.gsm8k.env.GSM8kEnv``)."""
DATA_SOURCE = "synthetic_gsm8k"


def user_message(question: str) -> str:
    """The user message SkyRL's gsm8k_dataset.py builds: the question, a space, the ``####`` instruction."""
    return f"{question} {GSM8K_INSTRUCTION}"


def problem_to_skyrl_row(problem: Problem, split: str, index: int) -> dict[str, Any]:
    """One row in the format of SkyRL's gsm8k_dataset.py (see the module docstring)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": user_message(problem.question)}],
        "env_class": ENV_CLASS,
        "reward_spec": {"method": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "answer": problem.answer_text, "question": problem.question},
    }


def make_skyrl_rows(n: int, seed: int = 0, variant: str = "standard", split: str = "train") -> list[dict[str, Any]]:
    """``n`` SkyRL-format rows of generated problems, deterministic given ``(n, seed, variant, split)``."""
    return [problem_to_skyrl_row(p, split, i) for i, p in enumerate(generate_problems(n, seed, variant, split))]


def load_skyrl_parquet(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a SkyRL-format GSM8K parquet file as SkyRL's PromptDataset yields them (unchanged); a row
    without a chat ``prompt`` or a ``reward_spec.ground_truth`` is a ValueError naming it."""
    rows = load_skyrl_rows(path)
    for index, row in enumerate(rows):
        if (row.get("reward_spec") or {}).get("ground_truth") is None:
            raise ValueError(f"row {index} has no reward_spec.ground_truth")
    return rows


def write_skyrl_gsm8k(output_dir: str | Path, train_size: int, val_size: int, seed: int = 0,
                      variant: str = "standard") -> tuple[Path, Path]:
    """Writes ``train.parquet`` (``train_size`` rows) and ``validation.parquet`` (``val_size`` rows, split
    ``test``) into ``output_dir``, as SkyRL's gsm8k_dataset.py does; returns their paths."""
    out = Path(output_dir).expanduser()
    train = save_rows_parquet(make_skyrl_rows(train_size, seed, variant, "train"), out / "train.parquet")
    val = save_rows_parquet(make_skyrl_rows(val_size, seed, variant, "test"), out / "validation.parquet")
    return train, val


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="~/data/gsm8k")
    parser.add_argument("--train_size", type=int, default=1000)
    parser.add_argument("--val_size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=VARIANTS, default="standard")
    args = parser.parse_args(argv)
    for path in write_skyrl_gsm8k(args.output_dir, args.train_size, args.val_size, args.seed, args.variant):
        print(path)


if __name__ == "__main__":
    main()
