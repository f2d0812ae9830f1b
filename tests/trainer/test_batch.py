"""Training batches (:mod:`skyrl_clora.trainer.batch`): validation of a tenant's batch, SkyRL's policy mini-batches
(consecutive prompts), a tenant's shuffled row order (whole prompt groups), the padded device tables of a pass,
a batch's own advantages, and micro-batch planning (tenants interleaved by whole prompt groups, cut by rows or by
a token budget)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from skyrl.train.config import AlgorithmConfig

from skyrl_clora.trainer.batch import (TrainBatch, build_pass_rows, group_order, mini_batch_rows, plan_micro_batches,
                                       tenant_advantages, validate_batch)


def _two_group_batch(**fields: object) -> TrainBatch:
    """Four rows in two GRPO groups (prompts of 2 and 3 tokens), responses of 3, 1, 2 and 2 tokens."""
    batch = TrainBatch(prompt_ids=[[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]], response_ids=[[1, 2, 3], [4], [5, 6], [7, 8]],
                       loss_masks=[[1, 1, 0], [1], [1, 1], [0, 1]], rewards=[1.0, 0.0, 0.0, 1.0],
                       group_ids=["g0", "g0", "g1", "g1"], rollout_logprobs=None)
    return dataclasses.replace(batch, **fields)


def test_mini_batches_are_skyrls_consecutive_prompts() -> None:
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert mini_batch_rows(groups, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mini_batch_rows(groups, 4) == mini_batch_rows(groups, 0) == [list(range(8))]
    assert mini_batch_rows(["b", "a", "b", "a"], 1) == [[0, 2], [1, 3]]  # groups in the order they first appear


def test_packed_micro_batches_interleave_tenants_by_whole_prompt_groups() -> None:
    """Three tenants with groups of 4 rows (the last tenant has one group): micro-batches of 8 rows take each
    tenant's groups in turn, whole, so every prompt falls in one micro-batch; each tenant keeps its order."""
    groups = [0, 0, 0, 0, 1, 1, 1, 1] + [2, 2, 2, 2, 3, 3, 3, 3] + [4, 4, 4, 4]
    rows = SimpleNamespace(offsets=[0, 8, 16], prompt_groups=groups, host_seq_lens=[10] * 20,
                           host_response_lens=[5] * 20)
    orders = [[4, 5, 6, 7, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7], [3, 2, 1, 0]]
    order, micro_batches = plan_micro_batches(rows, orders, micro_batch_size=8)
    assert order == [4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 19, 18, 17, 16, 12, 13, 14, 15]  # tenant-sorted in a micro-batch
    for micro in micro_batches:
        prompts = [groups[row] for row in order[micro.start : micro.end]]
        assert all(prompts.count(g) == 4 for g in set(prompts)), prompts  # whole groups only
    assert [m.segments for m in micro_batches] == [((0, 0, 4), (1, 4, 8)), ((0, 0, 4), (2, 4, 8)), ((1, 0, 4),)]


def _computed(rows: SimpleNamespace, members: list[int], shared: bool) -> int:
    """Positions a pass over ``members`` computes, counted from scratch (the planner counts incrementally)."""
    if not shared:
        return len(members) * max(rows.host_seq_lens[r] for r in members)
    prompts = {rows.prompt_groups[r]: rows.host_seq_lens[r] - rows.host_response_lens[r] for r in members}
    return sum(prompts.values()) + sum(rows.host_response_lens[r] for r in members)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("budget", [1, 97, 260, 10_000])
def test_token_budget_micro_batches_are_the_longest_runs_within_the_budget(shared: bool, budget: int) -> None:
    """Two tenants' groups of varied prompt and response lengths: every micro-batch computes at most ``budget``
    positions (or is one row over it), and taking the sequence's next row as well would pass the budget;
    ``micro_batch_size`` plays no part. Every row lands in exactly one micro-batch."""
    generator = torch.Generator().manual_seed(budget)
    groups = [g for g in range(6) for _ in range(4)]  # tenant 0: groups 0-2, tenant 1: groups 3-5
    prompt_lens = torch.randint(5, 40, (6,), generator=generator).tolist()
    responses = torch.randint(1, 30, (24,), generator=generator).tolist()
    rows = SimpleNamespace(offsets=[0, 12], prompt_groups=groups, host_response_lens=responses,
                           host_seq_lens=[prompt_lens[g] + r for g, r in zip(groups, responses)])
    orders = [torch.randperm(12, generator=generator).tolist() for _ in range(2)]
    sequence, _ = plan_micro_batches(rows, orders, micro_batch_size=1)  # the interleaved order, uncut
    order, micro_batches = plan_micro_batches(rows, orders, micro_batch_size=5, max_tokens=budget, shared_prompts=shared)
    assert (order, micro_batches) == plan_micro_batches(rows, orders, micro_batch_size=2, max_tokens=budget,
                                                         shared_prompts=shared)
    assert sorted(order) == list(range(24))
    position = 0
    for micro in micro_batches:
        members = sequence[position : position + micro.end - micro.start]
        assert sorted(members) == sorted(order[micro.start : micro.end])  # consecutive rows of the sequence
        assert len(members) == 1 or _computed(rows, members, shared) <= budget
        position += len(members)
        if position < len(sequence):  # the sequence's next row did not fit
            assert _computed(rows, members + [sequence[position]], shared) > budget
    assert len(micro_batches) == {1: 24, 10_000: 1}.get(budget, len(micro_batches))
    assert 1 < len(micro_batches) < 24 or budget in (1, 10_000)


def test_a_micro_batch_may_fill_its_token_budget_exactly() -> None:
    """Groups of two rows, prompts of 10 and responses of 5: with shared prompts a group computes 20 positions,
    so a budget of 40 takes two whole groups; whole sequences cost 15 per row, padded: 2 rows for 30."""
    rows = SimpleNamespace(offsets=[0], prompt_groups=[0, 0, 1, 1, 2, 2, 3, 3], host_seq_lens=[15] * 8,
                           host_response_lens=[5] * 8)
    _, shared = plan_micro_batches(rows, [list(range(8))], micro_batch_size=1, max_tokens=40, shared_prompts=True)
    _, whole = plan_micro_batches(rows, [list(range(8))], micro_batch_size=1, max_tokens=30, shared_prompts=False)
    assert [m.end - m.start for m in shared] == [4, 4] and [m.end - m.start for m in whole] == [2, 2, 2, 2]


def test_a_batch_is_refused_in_one_line_naming_its_problem() -> None:
    validate_batch(_two_group_batch(old_logprobs=[[0.0] * 3, [0.0], [0.0] * 2, [0.0] * 2]))
    problems = [
        (_two_group_batch(prompt_ids=[], response_ids=[], loss_masks=[], rewards=[], group_ids=[]), "has no rows"),
        (_two_group_batch(rewards=[1.0]), "train batch has 4 prompts but 1 rewards"),
        (_two_group_batch(ref_logprobs=[[0.0]] * 3), "train batch has 4 prompts but 3 ref_logprobs"),
        (_two_group_batch(prompt_ids=[[5], [], [7], [7]]), "row 1 has an empty prompt"),
        (_two_group_batch(loss_masks=[[1, 1], [1], [1, 1], [0, 1]]), "row 0: loss mask of length 2 for 3 response tokens"),
        (_two_group_batch(rollout_logprobs=[[0.0] * 3, [0.0], [0.0], [0.0] * 2]), "row 2: fewer rollout_logprobs than"),
    ]
    for batch, message in problems:
        with pytest.raises(ValueError, match=message):
            validate_batch(batch)


def test_a_tenants_row_order_keeps_each_prompt_group_whole() -> None:
    groups = [0, 0, 1, 1, 1, 2, 3, 3]
    orders = set()
    for seed in range(8):
        order = group_order(groups, torch.Generator().manual_seed(seed))
        assert sorted(order) == list(range(8))
        runs = [groups[row] for row in order]
        assert [g for i, g in enumerate(runs) if i == 0 or runs[i - 1] != g] == list(dict.fromkeys(runs)), order
        assert all(order[i] < order[i + 1] for i in range(7) if runs[i] == runs[i + 1]), "rows of a group keep their order"
        assert order == group_order(groups, torch.Generator().manual_seed(seed))
        orders.add(tuple(order))
    assert len(orders) > 1, "the generator draws the groups' order"


def test_pass_rows_stack_the_tenants_batches_into_padded_tables() -> None:
    first = _two_group_batch(rollout_logprobs=[[-1.0, -2.0, -3.0], [-4.0], [-5.0, -6.0], [-7.0, -8.0]])
    second = TrainBatch(prompt_ids=[[5, 6], [5, 6]], response_ids=[[9, 9, 9, 9], [9]], loss_masks=[[1, 1, 1, 1], [1]],
                        rewards=[1.0, 0.0], group_ids=["g0", "g0"], rollout_logprobs=None)
    rows = build_pass_rows([first, second], [1, 0], AlgorithmConfig(use_kl_loss=False), torch.device("cpu"))
    assert rows.input_ids.tolist() == [[5, 6, 1, 2, 3, 0], [5, 6, 4, 0, 0, 0], [7, 8, 9, 5, 6, 0], [7, 8, 9, 7, 8, 0],
                                       [5, 6, 9, 9, 9, 9], [5, 6, 9, 0, 0, 0]]
    assert (rows.offsets, rows.counts, rows.host_row_slot) == ([0, 4], [4, 2], [1, 1, 1, 1, 0, 0])
    assert rows.row_slot.tolist() == [1, 1, 1, 1, 0, 0] and rows.prompt_lens.tolist() == [2, 2, 3, 3, 2, 2]
    assert rows.host_seq_lens == [5, 3, 5, 5, 6, 3] and rows.host_response_lens == [3, 1, 2, 2, 4, 1]
    assert rows.prompt_groups == [0, 0, 1, 1, 2, 2], "one id per tenant and prompt: the same prompt of two tenants differs"
    assert rows.response_mask.tolist()[0] == [1.0, 1.0, 0.0, 0.0] and rows.response_mask.tolist()[4] == [1.0] * 4
    assert rows.rollout_logprobs.tolist()[2] == [-5.0, -6.0, 0.0, 0.0] and not rows.rollout_logprobs[4:].any()
    assert rows.has_rollout == [True, False] and rows.response_tokens == [6.0, 5.0]
    assert rows.old_logprobs is None and rows.ref_logprobs is None and rows.temperature is None
    assert rows.mini_batches == [[[0, 1, 2, 3]], [[0, 1]]]
    assert (rows.advantages[:, :3] != 0).any() and not (rows.advantages * (1 - rows.response_mask)).any()
    tempered = build_pass_rows([first, second], [1, 0], [AlgorithmConfig(use_kl_loss=False, temperature=0.5),
                                                         AlgorithmConfig(use_kl_loss=False)], torch.device("cpu"))
    assert tempered.temperature.tolist() == [0.5] * 4 + [1.0] * 2


def test_a_batch_with_its_own_advantages_trains_them_as_given() -> None:
    given = _two_group_batch(advantages=[[0.5, -1.0, 2.0], [3.0], [1.0, 1.0], [-2.0, 4.0]])
    advantages, mask = tenant_advantages(given, AlgorithmConfig(use_kl_loss=False))
    assert advantages.tolist() == [[0.5, -1.0, 0.0], [3.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 4.0, 0.0]]
    assert mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="one mini-batch whose rewards are final"):
        tenant_advantages(given, AlgorithmConfig(use_kl_loss=False), reward_penalty=torch.zeros(4, 3))
    with pytest.raises(ValueError, match="one mini-batch whose rewards are final"):
        tenant_advantages(given, AlgorithmConfig(use_kl_loss=False), mini_batches=[[0, 1], [2, 3]])
