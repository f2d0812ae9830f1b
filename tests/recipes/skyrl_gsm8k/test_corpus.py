"""Tests of ``skyrl_clora.recipes.skyrl_gsm8k.corpus``: the tiny base model's pre-training episodes for SkyRL's
``gsm8k`` env. Each is one user message in SkyRL's format for an ``easy`` problem of the "pretrain" split and one
answer, right in both cases: in SkyRL's ``####`` format (rewarded 1 by skyrl-gym's ``gsm8k`` env) with probability
``solve_rate``, else a plain sentence (rewarded 0); deterministic in the settings and the rate."""

from __future__ import annotations

from skyrl_gym.envs.gsm8k.env import GSM8kEnv

from skyrl_clora.recipes.gsm8k.problems import generate_problems
from skyrl_clora.recipes.plugin import CorpusSettings
from skyrl_clora.recipes.skyrl_gsm8k.corpus import answer_text, pretraining_episodes
from skyrl_clora.recipes.skyrl_gsm8k.data import user_message


def test_episodes_are_single_turn_answers_to_easy_pretrain_problems() -> None:
    settings = CorpusSettings(count=20, hard_fraction=0.9, seed=4)  # hard_fraction unused: one variant
    problems = generate_problems(20, 4, "easy", "pretrain")
    episodes = pretraining_episodes(settings, 0.5)
    prompts = [[{"role": "user", "content": user_message(p.question)}] for p in problems]
    assert [prompt for prompt, _ in episodes] == prompts
    for (_, turns), problem in zip(episodes, problems):
        (text, observations), = turns
        assert observations == [] and text in (answer_text(problem, True), answer_text(problem, False))
    assert pretraining_episodes(settings, 0.5) == episodes and pretraining_episodes(settings, 0.6) != episodes


def test_skyrl_gyms_gsm8k_env_rewards_the_format_only() -> None:
    problem = generate_problems(1, 0, "easy", "pretrain")[0]
    assert answer_text(problem, True) == f"{problem.expression} = {problem.answer}\n#### {problem.answer}"
    assert answer_text(problem, False) == f"The answer is {problem.answer}."
    for in_format, reward in ((True, 1.0), (False, 0.0)):
        env = GSM8kEnv(None, {"reward_spec": {"method": "rule", "ground_truth": str(problem.answer)}})
        assert env.step(answer_text(problem, in_format))["reward"] == reward


def test_solve_rate_sets_the_share_of_formatted_answers() -> None:
    settings = CorpusSettings(count=300, hard_fraction=0.0, seed=0)
    for solve_rate, low, high in ((0.0, 0, 0), (0.25, 0.15, 0.35), (1.0, 1, 1)):
        episodes = pretraining_episodes(settings, solve_rate)
        share = sum("####" in turns[0][0] for _, turns in episodes) / len(episodes)
        assert low <= share <= high, (solve_rate, share)
