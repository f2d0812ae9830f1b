"""Tests of ``skyrl_clora.recipes.gsm8k.corpus``: the tiny base model's pre-training episodes for the calculator
task. Each is the recipe's prompt and either a calculator call with the problem's expression followed by its result
as the final answer (scored 1 by the ``gsm8k_calc`` environment) or a direct, always wrong, final answer (scored 0),
the first with probability ``solve_rate``; problems come from the "pretrain" split, ``hard_fraction`` of them from
the hard variant, and the episodes are a pure function of the settings and the rate."""

from __future__ import annotations

import random

from skyrl_clora.recipes.gsm8k.corpus import pretraining_episodes, prompt_messages, trace_turns
from skyrl_clora.recipes.gsm8k.env import GSM8KCalcEnv
from skyrl_clora.recipes.gsm8k.problems import SYSTEM_PROMPT, Problem, generate_problems
from skyrl_clora.recipes.gsm8k.tools import parse_tool_call
from skyrl_clora.recipes.plugin import CorpusSettings, Episode


def _problems_by_question(settings: CorpusSettings) -> dict[str, Problem]:
    """The pretrain-split problems an episode set of ``settings`` is drawn from, by question."""
    num_hard = round(settings.count * settings.hard_fraction)
    problems = generate_problems(settings.count - num_hard, settings.seed, "standard", "pretrain")
    problems += generate_problems(num_hard, settings.seed, "hard", "pretrain")
    return {p.question: p for p in problems}


def _play(episode: Episode, ground_truth: int) -> float:
    """The reward ``gsm8k_calc`` gives the episode's assistant turns, checking each observation on the way."""
    env = GSM8KCalcEnv(None, {"reward_spec": {"ground_truth": str(ground_truth)}})
    prompt, turns = episode
    assert env.init(prompt)[0] == prompt
    for index, (text, observations) in enumerate(turns):
        out = env.step(text)
        assert out["done"] == (index == len(turns) - 1)
        assert out["observations"] == observations
    return out["reward"]


def test_episodes_come_from_the_pretrain_split_with_the_hard_share() -> None:
    settings = CorpusSettings(count=40, hard_fraction=0.25, seed=3)
    episodes = pretraining_episodes(settings, solve_rate=0.5)
    by_question = _problems_by_question(settings)
    questions = [prompt[1]["content"] for prompt, _ in episodes]
    assert len(episodes) == 40 and sorted(questions) == sorted(by_question)
    hard = set(p.question for p in generate_problems(10, 3, "hard", "pretrain"))
    assert sum(q in hard for q in questions) == 10
    train = {p.question for p in generate_problems(40, 3, "standard", "train")}
    assert not train & set(questions)
    assert all(prompt == prompt_messages(prompt[1]["content"]) for prompt, _ in episodes)
    assert prompt_messages("q") == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "q"}]


def test_solved_episodes_score_one_and_unsolved_ones_zero() -> None:
    settings = CorpusSettings(count=30, hard_fraction=0.5, seed=1)
    by_question = _problems_by_question(settings)
    for solve_rate, reward, turns in ((1.0, 1.0, 2), (0.0, 0.0, 1)):
        for episode in pretraining_episodes(settings, solve_rate):
            problem = by_question[episode[0][1]["content"]]
            assert len(episode[1]) == turns and _play(episode, problem.answer) == reward, episode
            if turns == 2:
                call = parse_tool_call(episode[1][0][0])
                assert call is not None and call.arguments == {"expression": problem.expression}


def test_solve_rate_sets_the_share_of_calculator_episodes_and_everything_is_seeded() -> None:
    settings = CorpusSettings(count=200, hard_fraction=0.3, seed=0)
    episodes = pretraining_episodes(settings, 0.3)
    share = sum(len(turns) == 2 for _, turns in episodes) / len(episodes)
    assert 0.2 <= share <= 0.4
    assert pretraining_episodes(settings, 0.3) == episodes
    assert pretraining_episodes(settings, 0.31) != episodes
    assert pretraining_episodes(CorpusSettings(count=200, hard_fraction=0.3, seed=1), 0.3) != episodes


def test_a_wrong_guess_is_never_the_answer() -> None:
    rng = random.Random(0)
    for problem in generate_problems(100, seed=2, variant="easy", split="pretrain"):
        (text, observations), = trace_turns(problem, use_calculator=False, rng=rng)
        call = parse_tool_call(text)
        assert call is not None and call.name == "final_answer" and observations == []
        assert int(call.arguments["answer"]) != problem.answer and int(call.arguments["answer"]) >= 0
