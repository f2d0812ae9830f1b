"""Simulated customers for the retail environment.

A :class:`SimulatedUser` opens the conversation from the task's instruction (:meth:`reset`) and answers
each agent message (:meth:`step`); the episode ends when an answer contains :data:`STOP_TOKEN`.

- :class:`ScriptedUser` is deterministic (tests, CPU runs): it states the instruction, answers a fixed
  line, and stops after a number of agent messages or when the agent says one of its stop phrases.
- :class:`LLMUser` plays the customer with any text generator (the policy's sampler with no adapter,
  an OpenAI-compatible endpoint...), prompted as in tau-bench's LLM user simulation.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from typing import Awaitable, Callable, Protocol, Sequence

STOP_TOKEN = "###STOP###"

Message = dict[str, str]
# Messages in, text out; the text may be returned directly or through an awaitable.
GenerateFn = Callable[[list[Message]], "str | Awaitable[str]"]

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


class SimulatedUser(Protocol):
    """The customer side of an episode."""

    def reset(self, instruction: str) -> str:
        """Start a conversation for ``instruction``; returns the customer's first message."""
        ...

    def step(self, agent_message: str) -> str:
        """The customer's answer to ``agent_message`` (contains :data:`STOP_TOKEN` when done)."""
        ...


class ScriptedUser:
    """A deterministic customer: first message = the instruction; answers ``reply`` to each agent
    message, and :data:`STOP_TOKEN` to the ``max_replies``-th one or to one that contains any of
    ``stop_phrases`` (case-insensitive)."""

    def __init__(
        self, max_replies: int = 3, stop_phrases: Sequence[str] = (), reply: str = "Yes, please go ahead."
    ) -> None:
        if int(max_replies) < 1:
            raise ValueError(f"ScriptedUser max_replies must be at least 1, got {max_replies}")
        if isinstance(stop_phrases, str):
            raise ValueError("ScriptedUser stop_phrases must be a list of strings, not one string")
        self.max_replies = int(max_replies)
        self.stop_phrases = tuple(phrase.lower() for phrase in stop_phrases)
        self.reply = reply
        self.replies_seen = 0

    def reset(self, instruction: str) -> str:
        self.replies_seen = 0
        return instruction

    def step(self, agent_message: str) -> str:
        self.replies_seen += 1
        message = agent_message.lower()
        if self.replies_seen >= self.max_replies or any(phrase in message for phrase in self.stop_phrases):
            return STOP_TOKEN
        return self.reply


USER_RULES: tuple[str, ...] = (
    "Just generate one line at a time to simulate the user's message.",
    "Do not give away all the instruction at once. Only provide the information that is necessary for the "
    "current step.",
    "Do not hallucinate information that is not provided in the instruction. For example, if the agent asks for "
    "the order id but it is not mentioned in the instruction, do not make up an order id, just say you do not "
    "remember or have it.",
    f"If the instruction goal is satisified, generate '{STOP_TOKEN}' as a standalone message without anything "
    "else to end the conversation.",
    "Do not repeat the exact instruction in the conversation. Instead, use your own words to convey the same "
    "information.",
    "Try to make the conversation as natural as possible, and stick to the personalities in the instruction.",
)


def user_system_prompt(instruction: str) -> str:
    """tau-bench's system prompt (word for word) for an LLM playing the customer of ``instruction``."""
    rules = "".join(f"\n- {rule}" for rule in USER_RULES)
    return f"You are a user interacting with an agent.\n\nInstruction: {instruction}\n\nRules:{rules}"


AGENT_GREETING = "Hi! How can I help you today?"


class LLMUser:
    """A customer played by a language model.

    ``generate(messages) -> text`` continues a chat in OpenAI message format (system / user /
    assistant), where ``user`` messages are the agent's and ``assistant`` messages are the customer's
    own; it may be a plain function or return an awaitable (an ``async def``). The conversation starts,
    as in tau-bench, with the customer's system prompt and the agent's greeting "Hi! How can I help you
    today?". A ``<think>...</think>`` block in the generated text is dropped before the message is kept.

    ``env.step`` is synchronous, so an awaitable is resolved here: on ``loop`` when given (the event
    loop that owns the generator, e.g. the sampler's; ``step`` must then run on another thread, as
    SkyRL's generator does with ``skyrl_gym.max_env_workers > 0``), or else with ``asyncio.run`` when
    this thread has no running loop. ``timeout_s`` bounds the wait for one message on ``loop``.
    """

    def __init__(
        self,
        generate: GenerateFn,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if not callable(generate):
            raise ValueError(f"LLMUser needs a callable generate(messages) -> text, got {type(generate).__name__}")
        self.generate = generate
        self.loop = loop
        self.timeout_s = timeout_s
        self.messages: list[Message] = []

    def reset(self, instruction: str) -> str:
        self.messages = [
            {"role": "system", "content": user_system_prompt(instruction)},
            {"role": "user", "content": AGENT_GREETING},
        ]
        return self._next_message()

    def step(self, agent_message: str) -> str:
        self.messages.append({"role": "user", "content": agent_message})
        return self._next_message()

    def _next_message(self) -> str:
        text = self._resolve(self.generate(list(self.messages)))
        if not isinstance(text, str):
            raise ValueError(f"the user's generate callable must return text, got {type(text).__name__}")
        text = _THINK_BLOCK.sub("", text).strip()
        self.messages.append({"role": "assistant", "content": text})
        return text

    def _resolve(self, result: "str | Awaitable[str]") -> object:
        if not inspect.isawaitable(result):
            return result
        running = _running_loop()
        if running is not None and (self.loop is None or running is self.loop):
            if inspect.iscoroutine(result):
                result.close()
            raise RuntimeError(
                "LLMUser cannot wait for its async generator on the thread of a running event loop; "
                "pass loop= (the generator's loop) and run env.step in a worker thread "
                "(skyrl_gym.max_env_workers > 0)"
            )
        if self.loop is not None:
            return asyncio.run_coroutine_threadsafe(_awaited(result), self.loop).result(self.timeout_s)
        return asyncio.run(_awaited(result))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _awaited(awaitable: Awaitable[str]) -> str:
    return await awaitable
