"""Tests of ``skyrl_clora.recipes.taubench.users``: the scripted customer (its first message the instruction, a
fixed answer, the stop token after ``max_replies`` agent messages or on a stop phrase) and the LLM customer
(tau-bench's system prompt and greeting, the conversation kept with roles as the benchmark keeps them, reasoning
dropped, async generators resolved on a given loop or with ``asyncio.run``, never blocking a running loop)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from skyrl_clora.recipes.taubench.users import STOP_TOKEN, LLMUser, ScriptedUser, user_system_prompt
from tests.support.taubench_retail import data_dir, make_env, tool_call  # noqa: F401 (data_dir: a fixture)


def test_scripted_user_counts_replies_and_stop_phrases() -> None:
    user = ScriptedUser(max_replies=3, stop_phrases=["Have a NICE day"], reply="ok")
    assert user.reset("instruction") == "instruction"
    assert [user.step("a"), user.step("have a nice day!")] == ["ok", STOP_TOKEN]
    user.reset("again")
    assert [user.step("a"), user.step("b"), user.step("c")] == ["ok", "ok", STOP_TOKEN]


class RecordingModel:
    """A fake customer model: answers from a script and records the conversations it was given."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = list(answers)
        self.seen: list[list[dict[str, str]]] = []

    def __call__(self, messages: list[dict[str, str]]) -> str:
        self.seen.append([dict(message) for message in messages])
        return self.answers.pop(0)


def test_llm_user_keeps_the_conversation_and_drives_an_episode(data_dir: Path) -> None:
    model = RecordingModel(["<think>hmm</think>I want to cancel an order.", "It's #W1000001.", STOP_TOKEN])
    env = make_env(data_dir, task_index=0, user_factory=lambda: LLMUser(model))
    conversation, _ = env.init([])
    assert conversation[-1] == {"role": "user", "content": "I want to cancel an order."}
    system = model.seen[0][0]["content"]
    assert system.startswith("You are a user interacting with an agent.\n\nInstruction: You are Ada Lovelace")
    assert "\n\nRules:\n- Just generate one line" in system and "generate '###STOP###' as a standalone" in system
    assert model.seen[0][1] == {"role": "user", "content": "Hi! How can I help you today?"}
    assert env.step("Which order?")["observations"] == [{"role": "user", "content": "It's #W1000001."}]
    env.step(tool_call("cancel_pending_order", {"order_id": "#W1000001", "reason": "no longer needed"}))
    out = env.step("Done, it is cancelled.")
    assert out["done"] and out["reward"] == 1.0
    roles = [message["role"] for message in model.seen[-1]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert model.seen[-1][-1]["content"] == "Done, it is cancelled."


def test_llm_user_resolves_async_generators() -> None:
    async def generate(messages: list[dict[str, str]]) -> str:
        await asyncio.sleep(0)
        return f"turn {len(messages)}"

    assert LLMUser(generate).reset("buy") == "turn 2"  # no running loop here: asyncio.run

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        user = LLMUser(generate, loop=loop, timeout_s=10)
        assert user.reset("buy") == "turn 2" and user.step("hello") == "turn 4"

        async def step_on_the_loop() -> None:
            user.step("deadlock?")

        with pytest.raises(RuntimeError, match="worker thread"):
            asyncio.run_coroutine_threadsafe(step_on_the_loop(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_scripted_user_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_replies must be at least 1, got 0"):
        ScriptedUser(max_replies=0)
    with pytest.raises(ValueError, match="a list of strings, not one string"):
        ScriptedUser(stop_phrases="bye")
    user = ScriptedUser(max_replies="2")  # a config value may arrive as text
    user.reset("x")
    assert [user.step("a"), user.step("b")] == ["Yes, please go ahead.", STOP_TOKEN]


def test_user_system_prompt_is_tau_benchs() -> None:
    prompt = user_system_prompt("Buy a lamp.")
    head, rules = prompt.split("\n\nRules:\n")
    assert head == "You are a user interacting with an agent.\n\nInstruction: Buy a lamp."
    lines = rules.split("\n")
    assert len(lines) == 6 and all(line.startswith("- ") for line in lines)
    assert lines[3] == ("- If the instruction goal is satisified, generate '###STOP###' as a standalone message "
                        "without anything else to end the conversation.")


def test_llm_user_drops_reasoning_and_refuses_what_is_not_text() -> None:
    user = LLMUser(lambda messages: "<think>\nplan\n</think>\n  Hello there. ")
    assert user.reset("i") == "Hello there." and user.messages[-1] == {"role": "assistant", "content": "Hello there."}
    with pytest.raises(ValueError, match="must return text, got int"):
        LLMUser(lambda messages: 3).reset("i")
    with pytest.raises(ValueError, match="needs a callable generate"):
        LLMUser("not callable")


def test_llm_user_never_blocks_a_running_loop_it_would_wait_on() -> None:
    async def generate(messages: list[dict[str, str]]) -> str:
        return "hi"

    async def reset_inside_a_loop() -> None:
        LLMUser(generate).reset("i")

    with pytest.raises(RuntimeError, match="cannot wait for its async generator"):
        asyncio.run(reset_inside_a_loop())
