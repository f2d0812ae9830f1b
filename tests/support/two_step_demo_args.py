"""The command line of a two-step demo run on a given model (two rows a step, one turn of at most 8 tokens), for
the train-mode tests of ``trainer/test_scheduler.py`` and the config checks of ``config/test_schema.py``."""

from __future__ import annotations

from pathlib import Path


def two_step_demo_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [f"trainer.policy.model.path={model_dir}", "preset=demo", f"clora.output_dir={out}", "trainer.max_training_steps=2",
            "clora.progress=false", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2", "recipe.eval_prompts=1",
            "generator.sampling_params.max_generate_length=8", "generator.max_turns=1", "trainer.max_prompt_length=120", *extra]
