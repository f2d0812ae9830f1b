"""``taubench_retail``: the tau-bench retail domain as a multi-turn skyrl-gym environment.

One episode = one task. :meth:`TauBenchRetailEnv.init` puts the policy document and the tool signatures
in the system message and appends the simulated customer's first message. Each :meth:`step` takes one
model output (see :mod:`.chat` for the format):

- with ``<tool_call>`` blocks: every call runs, in order, against the episode's database and its result
  comes back as a ``{"role": "tool"}`` observation (an unparsable block gives an error observation; a
  call to ``transfer_to_human_agents`` ends the episode and skips the calls after it);
- without: the text is a reply to the customer, whose answer is the ``{"role": "user"}`` observation;
  the episode ends when the answer contains ``###STOP###``.

The episode also ends, truncated, after ``max_turns`` steps. On the final step the observations are
empty and the reward is tau-bench's (:mod:`.reward`); a truncated episode gets 0.0, as the benchmark
gives an agent that runs out of steps, while its metrics still carry both checks. ``get_metrics()``
returns the reward breakdown with the episode's counts.

Settings come from ``env_config`` (the ``skyrl_gym.taubench_retail`` config section) overridden by the
episode's ``extras`` (the dataset row): see :class:`TauBenchRetailEnv`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

from skyrl_clora.recipes.taubench.chat import ToolCall, parse_agent_output, system_prompt
from skyrl_clora.recipes.taubench.data import ENV_CLASS, load_retail_data, resolve_task
from skyrl_clora.recipes.taubench.reward import RewardInfo, compute_reward, reward_metrics
from skyrl_clora.recipes.taubench.schemas import TOOL_SCHEMAS
from skyrl_clora.recipes.taubench.tools import TERMINATE_TOOLS, invoke
from skyrl_clora.recipes.taubench.users import STOP_TOKEN, ScriptedUser, SimulatedUser

ENV_ID = ENV_CLASS
DEFAULT_MAX_TURNS = 30


def _settings(env_config: Any, extras: Mapping[str, Any] | None) -> dict[str, Any]:
    """``env_config`` (a mapping, a DictConfig or an attribute object; may be None) overridden by ``extras``."""
    merged: dict[str, Any] = {}
    if env_config is not None:
        items = env_config.items() if hasattr(env_config, "items") else vars(env_config).items()
        merged.update({key: value for key, value in items if value is not None})
    merged.update({key: value for key, value in (extras or {}).items() if value is not None})
    return merged


def _make_user(settings: Mapping[str, Any]) -> SimulatedUser:
    """The episode's customer: ``user_factory()`` when given, else the ``user`` kind ("scripted")."""
    factory: Callable[[], SimulatedUser] | None = settings.get("user_factory")
    if factory is not None:
        if not callable(factory):
            raise ValueError(f"user_factory must be a callable returning a SimulatedUser, got {factory!r}")
        return factory()
    kind = settings.get("user", "scripted")
    if kind != "scripted":
        raise ValueError(f"unknown tau-bench user {kind!r}: use 'scripted' or pass a user_factory")
    options = settings.get("scripted_user") or {}
    return ScriptedUser(**dict(options))


class TauBenchRetailEnv(BaseTextEnv):
    """A tau-bench retail episode.

    Settings (``extras`` override ``env_config``):

    - ``data_path`` (required): the tau-bench retail data folder.
    - the task, either ``task_index`` (int) with ``task_split`` ("train" (default), "test", "dev"), or
      ``task``: the task itself as a dict (``user_id``, ``instruction``, ``actions``, ``outputs``).
    - ``max_turns`` (default 30, tau-bench's step limit): model outputs before the episode is truncated.
      SkyRL's generator sets it in ``extras`` from ``generator.max_turns``.
    - the customer: ``user_factory`` (a callable ``() -> SimulatedUser``, e.g. building an
      :class:`.users.LLMUser`), else ``user: "scripted"`` (default) with ``scripted_user`` holding
      :class:`.users.ScriptedUser` keyword arguments (``max_replies``, ``stop_phrases``, ``reply``).
    """

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        settings = _settings(env_config, extras)
        if "data_path" not in settings:
            raise ValueError("taubench_retail needs data_path (a tau-bench retail data folder) in extras or env_config")
        self.data = load_retail_data(settings["data_path"])
        self.task = resolve_task(
            settings["data_path"],
            task=settings.get("task"),
            split=settings.get("task_split", "train"),
            index=settings.get("task_index"),
        )
        self.max_turns = int(settings.get("max_turns", DEFAULT_MAX_TURNS))
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")
        self.user = _make_user(settings)
        self.db = self.data.fresh_db()
        self.replies: list[str] = []
        self.tool_calls = 0
        self.tool_errors = 0
        self.ended_by = ""
        self.reward_info: RewardInfo | None = None

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """The conversation to start from: the agent's system message (policy and tools), the prompt's own
        non-system messages, then the customer's first message."""
        first_message = self.user.reset(self.task.instruction)
        conversation = [{"role": "system", "content": system_prompt(self.data.policy, TOOL_SCHEMAS)}]
        conversation += [message for message in prompt if message.get("role") != "system"]
        conversation.append({"role": "user", "content": first_message})
        return conversation, {}

    def _run_call(self, call: ToolCall | str) -> str:
        if isinstance(call, str):
            self.tool_errors += 1
            return call
        self.tool_calls += 1
        observation = invoke(self.db, call.name, call.arguments)
        if observation.startswith(("Error", "Unknown action")):
            self.tool_errors += 1
        if call.name in TERMINATE_TOOLS:
            self.ended_by = "transfer"
        return observation

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Act on one model output; see the module docstring for what ends the episode."""
        if self.ended_by:
            raise RuntimeError("taubench_retail episode already ended; make a new environment")
        self.turns += 1
        message = parse_agent_output(action)
        observations: ConversationType = []
        if message.reply is None:
            for call in message.calls:
                observations.append({"role": "tool", "content": self._run_call(call)})
                if self.ended_by:
                    break
        else:
            self.replies.append(message.reply)
            answer = self.user.step(message.reply)
            observations.append({"role": "user", "content": answer})
            if STOP_TOKEN in answer:
                self.ended_by = "user_stop"
        if not self.ended_by and self.turns >= self.max_turns:
            self.ended_by = "max_turns"
        if not self.ended_by:
            return BaseTextEnvStepOutput(observations=observations, reward=0.0, done=False, metadata={})
        self.reward_info = compute_reward(self.db, self.data, self.task, self.replies)
        reward = 0.0 if self.ended_by == "max_turns" else self.reward_info.reward
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata=self.get_metrics())

    def get_metrics(self) -> dict[str, Any]:
        """The episode's reward breakdown and counts (reward info only once the episode has ended).

        ``failed_check`` names what made the reward 0.0 ("actions", "outputs", both joined by "+", with
        "max_turns" first for a truncated episode; "" on success); the numeric entries average across
        episodes in skyrl-gym's default aggregation.
        """
        metrics: dict[str, Any] = {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "agent_replies": len(self.replies),
            "ended_by": self.ended_by,
            "truncated": float(self.ended_by == "max_turns"),
            "transferred": float(self.ended_by == "transfer"),
        }
        if self.reward_info is not None:
            failed = (["max_turns"] if self.ended_by == "max_turns" else []) + self.reward_info.failed_checks
            metrics.update(reward_metrics(self.reward_info))
            metrics["reward"] = 0.0 if self.ended_by == "max_turns" else self.reward_info.reward
            metrics["failed_check"] = "+".join(failed)
        return metrics


def register_taubench_env() -> None:
    """Register ``taubench_retail`` in skyrl-gym's registry (no-op when already registered)."""
    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:TauBenchRetailEnv")
