"""Builds (or rebuilds with --force) the embedded tiny base model and measures how weak it starts.

    python scripts/build_tiny_base.py [--force] [--cache-root DIR] [--episodes 200] [--steps N]

Builds the default tiny base (pre-trained on the gsm8k recipe's corpus, as conf/model/tiny.yaml says) and
prints the pre-training time, then plays `--episodes` calculator-task episodes per task variant with
the base model sampled at temperature 1.0 and reports accuracy, calculator-usage rate, accuracy with
and without the calculator, and tokens per episode (see skyrl_clora.recipes.gsm8k.evaluate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from skyrl_clora.recipes.gsm8k import VARIANTS, make_dataset_rows
from skyrl_clora.recipes.gsm8k.evaluate import evaluate_policy
from skyrl_clora.tiny_base.pretrain import TinyBaseRecipe, ensure_tiny_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="rebuild even if the cached model exists")
    parser.add_argument("--cache-root", type=Path, default=None, help="default: $SKYRL_CLORA_CACHE or ~/.cache/skyrl-clora")
    parser.add_argument("--episodes", type=int, default=200, help="evaluation episodes per variant (0: skip)")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's pre-training steps")
    parser.add_argument("--seed", type=int, default=0, help="evaluation sampling seed")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    recipe = TinyBaseRecipe(corpus="gsm8k")
    if args.steps is not None:
        recipe = TinyBaseRecipe(corpus="gsm8k", steps=args.steps, prior_steps=min(recipe.prior_steps, args.steps))
    start = time.monotonic()
    path = ensure_tiny_base(args.cache_root, recipe, force=args.force)
    record = json.loads((path / "recipe.json").read_text())
    print(f"model: {path}")
    print(f"ensure_tiny_base took {time.monotonic() - start:.1f}s (this call); build record: "
          f"pre-training {record['train_seconds']:.1f}s, {record['num_params']} params, "
          f"loss {record['first_loss']:.3f} -> {record['final_loss']:.3f}")
    if args.episodes <= 0:
        return
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for variant in VARIANTS:
        rows = make_dataset_rows(args.episodes, seed=0, variant=variant, split="test")
        result = evaluate_policy(model, tokenizer, rows, seed=args.seed)
        print(f"[{variant}] " + ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in dataclasses.asdict(result).items()))


if __name__ == "__main__":
    main()
