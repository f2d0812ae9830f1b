"""The agentic GSM8K environment: the policy calls a `calculator` tool, then answers with `final_answer`.

Registered in skyrl-gym's registry as ``"gsm8k_calc"`` by `register_gsm8k_env()`, and driven by SkyRL's
own `SkyRLGymGenerator` (one `step` per assistant turn).

Episode rules (per assistant turn, see `tools.py` for the call syntax):

* ``calculator`` with ``{"expression": str}``: the result (or ``"error: ..."``) comes back as a
  ``{"role": "tool", "content": "91"}`` observation, which the chat template renders inside
  ``<tool_response></tool_response>``; reward 0, not done. A calculator call on the last allowed turn
  (``turns >= max_turns``) ends the episode with reward 0.
* ``final_answer`` with ``{"answer": str | number}``: done; reward 1.0 iff the answer equals the
  ground truth numerically, else 0.0.
* No tool call, malformed JSON, or an unknown tool name: done with reward 0.0 (no error observation:
  a retry would cost decode time on the CPU engine and the task is short enough not to need one).
"""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from skyrl_clora.recipes.gsm8k.problems import ENV_CLASS
from skyrl_clora.recipes.gsm8k.tools import (
    CALCULATOR,
    FINAL_ANSWER,
    CalculatorError,
    ToolCallError,
    calculate,
    numbers_equal,
    parse_tool_call,
)

DEFAULT_MAX_TURNS = 3
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


class GSM8KCalcEnv(BaseTextEnv):
    """Multi-turn calculator environment for one word problem.

    Args:
        env_config: unused (kept for skyrl-gym's ``make(env_class, env_config=..., extras=...)`` call).
        extras: ``{"reward_spec": {"ground_truth": str}, "max_turns": int (optional, default 3),
            "extra_info": {...} (optional; its "max_turns" is used when extras has none)}``.
    """

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        reward_spec = extras.get("reward_spec") or {}
        if reward_spec.get("ground_truth") is None:
            raise ValueError("gsm8k_calc env needs extras['reward_spec']['ground_truth']")
        self.ground_truth = str(reward_spec["ground_truth"])
        extra_info = extras.get("extra_info") or {}
        self.max_turns = int(extras.get("max_turns", extra_info.get("max_turns", DEFAULT_MAX_TURNS)))
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.used_calculator = False
        self.correct = False
        self.malformed = False

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """The prompt is used as given (system + user question)."""
        return prompt, {}

    def _finish(self, reward: float, tool: str | None) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"tool": tool})

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Applies one assistant turn (`action` = its decoded text, with or without the end token)."""
        self.turns += 1
        text = action
        for marker in _END_MARKERS:
            text = text.replace(marker, "")
        try:
            call = parse_tool_call(text)
        except ToolCallError:
            call = None
        if call is None or call.name not in (CALCULATOR, FINAL_ANSWER):
            self.malformed = True
            return self._finish(0.0, None if call is None else call.name)
        if call.name == FINAL_ANSWER:
            self.correct = numbers_equal(str(call.arguments.get("answer", "")), self.ground_truth)
            return self._finish(1.0 if self.correct else 0.0, FINAL_ANSWER)
        self.used_calculator = True
        if self.turns >= self.max_turns:
            return self._finish(0.0, CALCULATOR)
        try:
            result = calculate(str(call.arguments.get("expression", "")))
        except CalculatorError as err:
            result = f"error: {err}"
        return BaseTextEnvStepOutput(
            observations=[{"role": "tool", "content": result}], reward=0.0, done=False, metadata={"tool": CALCULATOR}
        )

    def get_metrics(self) -> dict[str, Any]:
        """``{"used_calculator": 0/1, "turns": int, "correct": 0/1, "malformed": 0/1}`` for this episode."""
        return {
            "used_calculator": int(self.used_calculator),
            "turns": self.turns,
            "correct": int(self.correct),
            "malformed": int(self.malformed),
        }


ENTRY_POINT = f"{__name__}:{GSM8KCalcEnv.__name__}"


def register_gsm8k_env() -> str:
    """Registers `GSM8KCalcEnv` in skyrl-gym's registry as "gsm8k_calc" (idempotent); returns the env id."""
    if ENV_CLASS not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_CLASS, entry_point=ENTRY_POINT)
    return ENV_CLASS
