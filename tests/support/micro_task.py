"""A micro task on which a micro model (conftest's ``learning_model_dir``) learns in a few CPU steps.

The environment ``micro_letters`` scores one assistant turn by the share of its non-space characters
that are letters a-m. The micro model samples such characters about a third of the time, so rewards vary
within every GRPO group from the first step, advantages and gradients are non-zero, and the policy
gradient moves each tenant's adapter (and so its samples) away from the base model and from the other
tenants; :func:`make_learnable_model` gives the rewarded tokens a shared embedding direction so that the
mean reward climbs within a few steps. The prompts are the GSM8K recipe's; a tenant takes the
environment with ``env_class: micro_letters``.

``run_args`` / ``read_records`` make and read a run of ``skyrl_clora.main`` on it; ``assert_learning``
is the precondition every end-to-end test on it asserts first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from skyrl_clora.checkpoints import LATEST

ENV_CLASS = "micro_letters"
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


class LetterRewardEnv(BaseTextEnv):
    """One turn; reward = letters a-m / non-space characters of the turn's text (0 for an empty turn)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        text = action
        for marker in _END_MARKERS:
            text = text.replace(marker, "")
        characters = [c for c in text if not c.isspace()]
        reward = sum("a" <= c <= "m" for c in characters) / len(characters) if characters else 0.0
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


def register_micro_env() -> str:
    """Registers :class:`LetterRewardEnv` as ``micro_letters`` (idempotent); returns the env id."""
    if ENV_CLASS not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_CLASS, entry_point=f"{__name__}:{LetterRewardEnv.__name__}")
    return ENV_CLASS


def micro_tenants(*tenants: dict[str, Any]) -> str:
    """The ``+tenants=[...]`` override of ``tenants`` (dicts of per-tenant keys), each on the micro task
    (registered here) unless it names its own ``env_class``."""
    register_micro_env()
    entries = []
    for tenant in tenants:
        keys = {"env_class": ENV_CLASS, **tenant}
        entries.append("{" + ",".join(f"{key}:{value}" for key, value in keys.items()) + "}")
    return f"+tenants=[{','.join(entries)}]"


def run_args(model_dir: Path, out: Path, *extra: str, steps: int = 3) -> list[str]:
    """``main`` arguments for a short run on the micro task (tenants come in ``extra``, see :func:`micro_tenants`)."""
    return [
        f"trainer.policy.model.path={model_dir}", "preset=demo", f"clora.output_dir={out}",
        f"trainer.max_training_steps={steps}", "clora.progress=false",
        "trainer.train_batch_size=4", "generator.n_samples_per_prompt=8", "recipe.eval_prompts=8",
        "generator.sampling_params.max_generate_length=8", "generator.max_turns=1", "trainer.max_prompt_length=200", "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.alpha=16", "sampler.max_lora_rank=8", *extra,
    ]


def read_records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def roll_back(out: Path, tenant: str, step: int) -> None:
    """Leaves ``tenant`` of the run in ``out`` as a crash right after its step-``step`` checkpoint would: newer
    checkpoints gone."""
    folder = out / "checkpoints" / tenant
    for newer in [p for p in folder.glob("global_step_*") if int(p.name.removeprefix("global_step_")) > step]:
        shutil.rmtree(newer)
    (folder / LATEST).write_text(str(step))


def assert_learning(records: list[dict[str, Any]]) -> None:
    """Every tenant step saw rewards that vary and took a non-zero gradient (the run trained something)."""
    steps = [r for r in records if r["event"] == "step"]
    assert steps, "no tenant finished a step"
    for record in steps:
        where = (record["tenant"], record["step"])
        assert record["train/grad_norm"] > 0, f"zero gradient at {where}"
        assert 0 < record["reward_mean"] < 1, f"rewards do not vary at {where}: mean {record['reward_mean']}"


def make_learnable_model(model_dir: Path, out: Path, lift: float = 0.5) -> Path:
    """Saves to ``out`` the model of ``model_dir`` with one direction ``u`` (seeded, unit norm) added, times
    ``lift``, to the embeddings of the tokens whose text is mostly letters a-m (the tied LM head then
    scores them together): a LoRA that moves the last hidden state along ``u`` raises the whole rewarded
    class at once, so the micro task is learnt in a few steps rather than dozens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    embeddings = model.get_input_embeddings().weight
    rewarded = [token for token in range(embeddings.shape[0]) if _mostly_rewarded(tokenizer.decode([token]))]
    direction = torch.randn(embeddings.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeddings[rewarded] += lift * direction / direction.norm()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _mostly_rewarded(text: str) -> bool:
    characters = [c for c in text if not c.isspace()]
    return bool(characters) and sum("a" <= c <= "m" for c in characters) > len(characters) / 2
