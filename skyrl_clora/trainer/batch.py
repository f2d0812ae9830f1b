"""Training batches: one tenant's rollouts, their validation, and the padded device tables of a pass.

A pass trains ``P`` tenants (``P = 1`` in swap mode) on the rows of all their batches. A tenant's batch is
cut into SkyRL's policy mini-batches (:func:`mini_batch_rows`: ``trainer.policy_mini_batch_size`` prompts each,
one optimizer step each). Each tenant's advantages are computed over its own batch with SkyRL's estimator and
scaled by its mini-batch's loss normaliser (``apply_loss_reduction_to_advantages_minibatch`` per mini-batch, as
SkyRL's ``_normalize_advantages``), so that summing the per-token policy loss over any grouping of a
mini-batch's rows into micro-batches gives the tenant's loss for that mini-batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_advantages_and_returns
from skyrl.train.config import AlgorithmConfig

from skyrl_clora.trainer.logprobs import training_temperature
from skyrl_clora.trainer.loss_reduction import reduce_advantages


@dataclass
class TrainBatch:
    """One tenant's rollouts for a step. Per trajectory: prompt and response token ids, the response's
    loss mask (1 = trained token), its scalar reward, its group id (GRPO groups the samples of one
    prompt) and the sampler's log-probs of the response tokens (or None).

    Optional per-token log-probs of the response tokens the update reads instead of computing them:
    ``old_logprobs``, the behaviour policy's (the PPO ratio's denominator; None: the trainer's own forward
    with the tenant's pre-update adapter, SkyRL's recomputed ``action_log_probs``), and ``ref_logprobs``,
    the reference policy's for SkyRL's KL loss (None: the trainer's forward with the adapter disabled).

    ``advantages``: per response token, the advantages the policy loss reads, already scaled by SkyRL's loss
    reduction for the optimizer step that trains them (what SkyRL's policy workers receive: the batch must then be
    one mini-batch); None: computed by the trainer from ``rewards`` and ``group_ids``."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_masks: list[list[int]]
    rewards: list[float]
    group_ids: list[str]
    rollout_logprobs: list[list[float]] | None
    old_logprobs: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    advantages: list[list[float]] | None = None


# The TrainBatch fields of per-token log-probs of the response tokens.
PER_TOKEN_LOGPROBS = ("rollout_logprobs", "old_logprobs", "ref_logprobs")
# Every per-token TrainBatch field (one value per response token).
PER_TOKEN = (*PER_TOKEN_LOGPROBS, "advantages")


def validate_batch(batch: TrainBatch) -> None:
    """Raises ValueError (one line naming the problem) unless ``batch`` is trainable."""
    rows = len(batch.prompt_ids)
    if rows == 0:
        raise ValueError("train batch has no rows")
    lengths = {"response_ids": len(batch.response_ids), "loss_masks": len(batch.loss_masks),
               "rewards": len(batch.rewards), "group_ids": len(batch.group_ids)}
    per_token = {name: getattr(batch, name) for name in PER_TOKEN if getattr(batch, name) is not None}
    lengths.update({name: len(values) for name, values in per_token.items()})
    for name, length in lengths.items():
        if length != rows:
            raise ValueError(f"train batch has {rows} prompts but {length} {name}")
    for index, (prompt, response, mask) in enumerate(zip(batch.prompt_ids, batch.response_ids, batch.loss_masks)):
        if not prompt:
            raise ValueError(f"train batch row {index} has an empty prompt")
        if len(mask) != len(response):
            raise ValueError(f"train batch row {index}: loss mask of length {len(mask)} for {len(response)} response tokens")
        for name, values in per_token.items():
            if len(values[index]) < len(response):
                raise ValueError(f"train batch row {index}: fewer {name} than response tokens")


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    """``[len(rows), width]`` fp32, row ``i`` holding ``rows[i][:width]`` then zeros."""
    lengths = torch.tensor([min(len(row), width) for row in rows])
    out = torch.zeros(len(rows), width)
    out[torch.arange(width)[None] < lengths[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(row[:width] for row in rows)), dtype=torch.float32)
    return out


def mini_batch_rows(group_ids: list[str], prompts: int) -> list[list[int]]:
    """SkyRL's policy mini-batches of one tenant's batch (``compute_prompt_mini_batch_boundaries``: consecutive
    prompts, ``trainer.policy_mini_batch_size`` of them per mini-batch, in batch order, never shuffled): the batch's
    prompt groups in the order they first appear, ``prompts`` groups per mini-batch (the last may hold fewer;
    ``prompts <= 0``: one mini-batch of every group). Returns each mini-batch's rows (local indices, ascending)."""
    distinct = list(dict.fromkeys(group_ids))
    per = prompts if prompts > 0 else max(1, len(distinct))
    index = {group: position // per for position, group in enumerate(distinct)}
    minis: list[list[int]] = [[] for _ in range(-(-len(distinct) // per))]
    for row, group in enumerate(group_ids):
        minis[index[group]].append(row)
    return minis


def tenant_advantages(batch: TrainBatch, algorithm: AlgorithmConfig, reward_penalty: torch.Tensor | None = None,
                      mini_batches: list[list[int]] | None = None, micro_batch_size: int = 1,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's advantages, each mini-batch's scaled by SkyRL's loss reduction of that mini-batch
    (:func:`~skyrl_clora.trainer.loss_reduction.reduce_advantages`, with its prompts' boundaries, ``micro_batch_size``
    for ``token_mean_legacy`` and ``algorithm.max_seq_len``; ``mini_batches``: rows per mini-batch,
    :func:`mini_batch_rows`; None: the whole batch is one), and its response mask: both
    ``[N, Lr]`` fp32 on the CPU (SkyRL's GRPO estimator builds its group statistics there), ``Lr`` = the longest
    response. The token-level rewards are each row's reward on its last trained token, minus ``reward_penalty``
    (``[N, >= Lr]``, SkyRL's KL penalty in the reward) when given. A batch with its own ``advantages`` (final, one
    mini-batch) gets them as they are."""
    response_mask = _pad([[float(m) for m in mask] for mask in batch.loss_masks],
                         max(1, max(len(r) for r in batch.response_ids)))
    if batch.advantages is not None:
        if reward_penalty is not None or (mini_batches is not None and len(mini_batches) > 1):
            raise ValueError("a batch with its own advantages is one mini-batch whose rewards are final; drop the "
                             "reward penalty or the mini-batches")
        return _pad(batch.advantages, response_mask.shape[1]) * response_mask, response_mask
    num_rows, response_len = response_mask.shape
    rewards = torch.zeros(num_rows, response_len)
    last = (response_mask.sum(dim=1) - 1).clamp(min=0).long()
    rewards[torch.arange(num_rows), last] = torch.tensor(batch.rewards, dtype=torch.float32)
    if reward_penalty is not None:
        rewards = rewards - reward_penalty[:, :response_len].cpu()
    advantages, _ = compute_advantages_and_returns(
        token_level_rewards=rewards, response_mask=response_mask, index=np.array(batch.group_ids),
        adv_estimator=algorithm.advantage_estimator, config=algorithm, grpo_norm_by_std=algorithm.grpo_norm_by_std,
        gamma=algorithm.gamma, lambd=algorithm.lambd,
    )
    return reduce_advantages(advantages, response_mask, batch.group_ids, mini_batches or [list(range(num_rows))],
                             algorithm, micro_batch_size), response_mask


@dataclass
class PassRows:
    """All rows of a pass on the device, tenant ``p``'s rows at ``offsets[p] : offsets[p] + counts[p]``.

    ``R`` rows, ``L`` = longest prompt + response, ``Lr`` = longest response: ``input_ids [R, L]`` int64
    (zero-padded), ``row_slot [R]`` int64 (the tenant's device slot), ``prompt_lens``/``seq_lens [R]`` int64,
    ``advantages``/``response_mask``/``rollout_logprobs [R, Lr]`` fp32 (zero beyond each row's response;
    rollout log-probs zero for tenants without them, ``has_rollout[p]`` False); ``old_logprobs`` and
    ``ref_logprobs`` likewise from the batches' fields of those names (``has_old``/``has_ref``), None when
    no batch of the pass has them. Host copies of the lengths
    (``host_seq_lens``, ``host_response_lens``) and slots (``host_row_slot``) size the micro-batches without
    a device synchronisation. ``prompt_groups[r]``: an id shared by the rows of one tenant with the same
    prompt (a GRPO group), which the forward computes once per micro-batch. ``mini_batches[p]``: tenant ``p``'s
    policy mini-batches (local row indices each, :func:`mini_batch_rows`), one optimizer step each.
    ``temperature [R]`` fp32: the temperature of each row's tenant (:func:`training_temperature`) its policy
    log-probs are computed at; None when every tenant's is 1.
    """

    input_ids: torch.Tensor
    row_slot: torch.Tensor
    prompt_lens: torch.Tensor
    seq_lens: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    host_seq_lens: list[int]
    host_response_lens: list[int]
    host_row_slot: list[int]
    prompt_groups: list[int]
    offsets: list[int]
    counts: list[int]
    has_rollout: list[bool]
    response_tokens: list[float]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    has_old: list[bool] | None = None
    has_ref: list[bool] | None = None
    mini_batches: list[list[list[int]]] | None = None
    temperature: torch.Tensor | None = None


def build_pass_rows(
    batches: list[TrainBatch], slots: list[int], algorithm: AlgorithmConfig | list[AlgorithmConfig],
    device: torch.device, reward_penalties: list[torch.Tensor] | None = None, mini_batch_prompts: int = 0,
    micro_batch_size: int = 1,
) -> PassRows:
    """Stacks the tenants' batches (each validated, cut into mini-batches of ``mini_batch_prompts`` prompts (<= 0:
    one), advantages per tenant with its ``algorithm`` (one, or one per batch) and ``micro_batch_size`` (SkyRL's
    ``micro_train_batch_size_per_gpu``, for ``token_mean_legacy``), with ``reward_penalties[p]`` taken off tenant
    ``p``'s token-level rewards when given: see :func:`tenant_advantages`) into one :class:`PassRows`."""
    for batch in batches:
        validate_batch(batch)
    penalties = reward_penalties or [None] * len(batches)
    algorithms = algorithm if isinstance(algorithm, list) else [algorithm] * len(batches)
    minis = [mini_batch_rows(batch.group_ids, mini_batch_prompts) for batch in batches]
    per_tenant = [tenant_advantages(batch, algo, penalty, mini, micro_batch_size)
                  for batch, algo, penalty, mini in zip(batches, algorithms, penalties, minis)]
    response_len = max(advantages.shape[1] for advantages, _ in per_tenant)
    prompts = [p for batch in batches for p in batch.prompt_ids]
    responses = [r for batch in batches for r in batch.response_ids]
    seq_lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(seq_lens)
    lengths = torch.tensor(seq_lens)
    input_ids = torch.zeros(len(seq_lens), width, dtype=torch.long)
    input_ids[torch.arange(width)[None] < lengths[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(p + r for p, r in zip(prompts, responses))), dtype=torch.long)

    def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(t, (0, response_len - t.shape[1])) for t in tensors])

    def per_token(name: str) -> torch.Tensor:
        return torch.cat([_pad(getattr(b, name), response_len) if getattr(b, name) is not None
                          else torch.zeros(len(b.prompt_ids), response_len) for b in batches])

    has_old = [b.old_logprobs is not None for b in batches]
    temperatures = [training_temperature(algo) for algo in algorithms]
    has_ref = [b.ref_logprobs is not None for b in batches]
    counts = [len(batch.prompt_ids) for batch in batches]
    host_row_slot = [slot for slot, count in zip(slots, counts) for _ in range(count)]
    group_of: dict[tuple[int, tuple[int, ...]], int] = {}
    prompt_groups = [group_of.setdefault((tenant, tuple(prompt)), len(group_of))
                     for tenant, batch in enumerate(batches) for prompt in batch.prompt_ids]

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    return PassRows(
        input_ids=to_device(input_ids), row_slot=to_device(torch.tensor(host_row_slot)),
        prompt_lens=to_device(torch.tensor([len(p) for p in prompts])), seq_lens=to_device(lengths),
        advantages=to_device(stack([a for a, _ in per_tenant])), response_mask=to_device(stack([m for _, m in per_tenant])),
        rollout_logprobs=to_device(per_token("rollout_logprobs")), host_seq_lens=seq_lens,
        host_response_lens=[len(r) for r in responses], host_row_slot=host_row_slot, prompt_groups=prompt_groups,
        offsets=list(itertools.accumulate([0] + counts[:-1])),
        counts=counts, has_rollout=[b.rollout_logprobs is not None for b in batches],
        response_tokens=[float(sum(sum(mask) for mask in b.loss_masks)) for b in batches],
        old_logprobs=to_device(per_token("old_logprobs")) if any(has_old) else None,
        ref_logprobs=to_device(per_token("ref_logprobs")) if any(has_ref) else None,
        has_old=has_old, has_ref=has_ref, mini_batches=minis,
        temperature=to_device(torch.tensor([t for t, count in zip(temperatures, counts) for _ in range(count)]))
        if any(t != 1.0 for t in temperatures) else None,
    )


class RowLengths(Protocol):
    """What micro-batch planning reads of a pass's rows (:class:`PassRows` has it; the pack planner's cost model
    builds it from lengths alone): per global row its sequence and response lengths and prompt group, and each
    tenant's first global row."""

    host_seq_lens: list[int]
    host_response_lens: list[int]
    prompt_groups: list[int]
    offsets: list[int]


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``order[start:end]`` of a pass (global row indices, grouped by tenant); ``segments``: per
    tenant present, ``(tenant index, first, last)`` positions within the micro-batch; ``width`` = its
    longest sequence, ``response_width`` = its longest response."""

    start: int
    end: int
    segments: tuple[tuple[int, int, int], ...]
    width: int
    response_width: int


def group_order(groups: list[int], generator: torch.Generator) -> list[int]:
    """A tenant's row order (local indices): its prompt groups (``groups[i]``: row ``i``'s group id) in an
    order drawn from ``generator``, each group's rows together in their own order, so that a micro-batch
    holds whole groups and computes each prompt once."""
    distinct = list(dict.fromkeys(groups))
    rank = dict(zip(distinct, torch.randperm(len(distinct), generator=generator).tolist()))
    return sorted(range(len(groups)), key=lambda row: (rank[groups[row]], row))


def plan_micro_batches(
    rows: RowLengths, orders: list[list[int]], micro_batch_size: int, max_tokens: int = -1, shared_prompts: bool = False
) -> tuple[list[int], list[MicroBatch]]:
    """Interleaves the tenants' shuffled row orders (``orders[p]``: tenant ``p``'s local row order) round-robin
    by runs of one prompt group (every tenant's first run, then every tenant's second, ...: a group's rows stay
    together, so a micro-batch computes a shared prompt once, as in swap mode), cuts the sequence into
    micro-batches and groups each by tenant (keeping each tenant's order). With one tenant this is its shuffled
    order cut into consecutive micro-batches. Returns the global row order and the micro-batches over it.

    The cut: ``micro_batch_size`` rows each when ``max_tokens <= 0``; otherwise (SkyRL's
    ``max_tokens_per_microbatch``, and ``micro_batch_size`` is ignored) as many rows as keep the tokens the pass
    computes within ``max_tokens`` (:func:`_token_chunks`)."""
    runs = []  # per tenant, its order cut into runs of consecutive rows of one prompt group
    for p, order in enumerate(orders):
        groups = [rows.prompt_groups[rows.offsets[p] + row] for row in order]
        runs.append([[(p, rows.offsets[p] + row) for _, row in run]
                     for _, run in itertools.groupby(zip(groups, order), key=lambda item: item[0])])
    sequence = [item for k in range(max(map(len, runs))) for tenant_runs in runs if k < len(tenant_runs)
                for item in tenant_runs[k]]
    if max_tokens <= 0:
        chunks = [sequence[start : start + micro_batch_size] for start in range(0, len(sequence), micro_batch_size)]
    else:
        chunks = _token_chunks(rows, sequence, max_tokens, shared_prompts)
    order: list[int] = []
    micro_batches = []
    for chunk in chunks:
        chunk = sorted(chunk, key=lambda item: item[0])
        segments, first = [], 0
        for tenant, group in itertools.groupby(chunk, key=lambda item: item[0]):
            size = len(list(group))
            segments.append((tenant, first, first + size))
            first += size
        start = len(order)
        order.extend(row for _, row in chunk)
        micro_batches.append(MicroBatch(
            start=start, end=start + len(chunk), segments=tuple(segments),
            width=max(rows.host_seq_lens[row] for _, row in chunk),
            response_width=max(1, max(rows.host_response_lens[row] for _, row in chunk)),
        ))
    return order, micro_batches


def _token_chunks(
    rows: RowLengths, sequence: list[tuple[int, int]], max_tokens: int, shared_prompts: bool
) -> list[list[tuple[int, int]]]:
    """Cuts ``sequence`` (``(tenant, global row)`` items) into consecutive chunks whose passes compute at most
    ``max_tokens`` token positions each (a row over it alone forms its own chunk). A pass computes, with
    ``shared_prompts``, each distinct prompt once plus every row's response (the trainer's shared-prompt pass;
    a chunk whose rows share no prompt runs whole sequences, padded, and may pass the budget by that padding);
    otherwise every row padded to the chunk's longest (its whole-sequence pass ``[rows, width]``)."""
    chunks: list[list[tuple[int, int]]] = []
    chunk: list[tuple[int, int]] = []
    prompts: set[int] = set()
    tokens = width = 0
    for item in sequence:
        row = item[1]
        seq_len, response_len, group = rows.host_seq_lens[row], rows.host_response_lens[row], rows.prompt_groups[row]
        if shared_prompts:
            grown = tokens + response_len + (0 if group in prompts else seq_len - response_len)
        else:
            grown = (len(chunk) + 1) * max(width, seq_len)
        if chunk and grown > max_tokens:
            chunks.append(chunk)
            chunk, prompts, width = [], set(), 0
            grown = seq_len  # one row: its prompt and response, shared or not
        chunk.append(item)
        prompts.add(group)
        tokens, width = grown, max(width, seq_len)
    chunks.append(chunk)
    return chunks
