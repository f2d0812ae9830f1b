"""The embedded trainer: GRPO steps for one tenant at a time through the AdapterStore (swap mode).

Advantages come from SkyRL's advantage-estimator registry and the loss from its policy-loss registry
(``skyrl.backends.skyrl_train.utils.ppo_utils``), configured by SkyRL's ``AlgorithmConfig``; the
optimizer is AdamW on each tenant's fp32 master weights with the tenant's own learning-rate schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import (
    PolicyLossRegistry,
    apply_loss_reduction_to_advantages_minibatch,
    compute_advantages_and_returns,
)
from skyrl.train.config import AlgorithmConfig

from skyrl_clora.lora.layers import AdapterWeights, LoRARouting, MultiLoRALinear
from skyrl_clora.trainer.adapter_store import AdapterStore


@dataclass
class TrainBatch:
    """One tenant's rollouts for a step. Per trajectory: prompt and response token ids, the response's
    loss mask (1 = trained token), its scalar reward, its group id (GRPO groups the samples of one
    prompt) and the sampler's log-probs of the response tokens (or None)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_masks: list[list[int]]
    rewards: list[float]
    group_ids: list[str]
    rollout_logprobs: list[list[float]] | None


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings shared by all tenants (the learning rate is per tenant, in its schedule)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0


class Trainer:
    """Runs GRPO steps on a trainer model whose LoRA layers are trainable slots managed by ``store``."""

    def __init__(
        self,
        model: torch.nn.Module,
        routing: LoRARouting,
        layers: dict[str, MultiLoRALinear],
        store: AdapterStore,
        algorithm: AlgorithmConfig,
        optimizer: OptimizerConfig,
        micro_batch_size: int,
    ) -> None:
        self.model = model
        self.routing = routing
        self.layers = layers
        self.store = store
        self.algorithm = algorithm
        self.optimizer = optimizer
        self.micro_batch_size = micro_batch_size
        self.policy_loss = PolicyLossRegistry.get(algorithm.policy_loss_type)
        self.device = store.device

    def train_step(self, tenant: str, batch: TrainBatch) -> tuple[AdapterWeights, dict[str, float]]:
        """Swaps ``tenant`` in, runs one policy update on ``batch``, swaps it out.

        Returns the tenant's new adapter weights (model dtype, for the sampler) and step metrics."""
        state = self.store.swap_in(tenant, 0)
        try:
            generator = torch.Generator().manual_seed(0)
            generator.set_state(state.rng_state)
            metrics = self._update(0, batch, state.schedule.lr(state.step), state.step + 1, generator)
            state.rng_state = generator.get_state()
            state.step += 1
        finally:
            self.store.swap_out(0)
        return state.weights, metrics

    def _update(
        self, slot: int, batch: TrainBatch, lr: float, step: int, generator: torch.Generator
    ) -> dict[str, float]:
        """Gradient of the policy loss over ``batch`` in shuffled micro-batches (shuffled with the tenant's
        RNG), then one AdamW step. Advantages and the loss normaliser are computed over the whole batch."""
        # Advantages are computed on the CPU (SkyRL's GRPO estimator builds its group statistics there).
        response_mask = _pad_float([[float(m) for m in mask] for mask in batch.loss_masks],
                                   max(1, max(len(r) for r in batch.response_ids)), torch.device("cpu"))
        num_rows, response_len = response_mask.shape
        rewards = torch.zeros(num_rows, response_len)
        last = (response_mask.sum(dim=1) - 1).clamp(min=0).long()
        rewards[torch.arange(num_rows), last] = torch.tensor(batch.rewards, dtype=torch.float32)
        advantages, _ = compute_advantages_and_returns(
            token_level_rewards=rewards,
            response_mask=response_mask,
            index=np.array(batch.group_ids),
            adv_estimator=self.algorithm.advantage_estimator,
            config=self.algorithm,
            grpo_norm_by_std=self.algorithm.grpo_norm_by_std,
            gamma=self.algorithm.gamma,
            lambd=self.algorithm.lambd,
        )
        advantages = apply_loss_reduction_to_advantages_minibatch(
            advantages, response_mask, self.algorithm.loss_reduction, micro_batch_size=num_rows, max_seq_len=response_len
        ).to(self.device)
        response_mask = response_mask.to(self.device)
        rollout_logprobs = None
        if batch.rollout_logprobs is not None:
            rollout_logprobs = _pad_float(batch.rollout_logprobs, response_len, self.device)
        for layer in self.layers.values():
            layer.lora_a.grad[slot].zero_()
            layer.lora_b.grad[slot].zero_()

        totals = {"policy_loss": 0.0, "logprob_sum": 0.0, "sampler_abs_diff": 0.0}
        order = torch.randperm(num_rows, generator=generator).tolist()
        for start in range(0, num_rows, self.micro_batch_size):
            rows = order[start : start + self.micro_batch_size]
            log_probs = self._response_logprobs(slot, batch, rows, response_len)
            mask = response_mask[rows]
            # One on-policy update per step: the "old" policy is the current one.
            loss, _ = self.policy_loss(
                log_probs, log_probs.detach(), advantages[rows], config=self.algorithm, loss_mask=mask,
                rollout_logprobs=None if rollout_logprobs is None else rollout_logprobs[rows],
            )
            loss.backward()
            totals["policy_loss"] += float(loss.detach())
            totals["logprob_sum"] += float((log_probs.detach() * mask).sum())
            if rollout_logprobs is not None:
                totals["sampler_abs_diff"] += float(((log_probs.detach() - rollout_logprobs[rows]).abs() * mask).sum())
        grad_norm = self._adamw(slot, lr, step)
        tokens = float(response_mask.sum().clamp(min=1))
        metrics = {
            "policy_loss": totals["policy_loss"],
            "grad_norm": grad_norm,
            "lr": lr,
            "response_tokens": float(response_mask.sum()),
            "mean_token_logprob": totals["logprob_sum"] / tokens,
        }
        if rollout_logprobs is not None:
            metrics["logprob_abs_diff_vs_sampler"] = totals["sampler_abs_diff"] / tokens
        return metrics

    def _response_logprobs(self, slot: int, batch: TrainBatch, rows: list[int], response_len: int) -> torch.Tensor:
        """Log-probs ``[len(rows), Lr]`` of the response tokens of ``rows`` under the slot's adapter."""
        sequences = [batch.prompt_ids[i] + batch.response_ids[i] for i in rows]
        seq_len = max(len(seq) for seq in sequences)
        input_ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, : len(seq)] = torch.tensor(seq)
        input_ids = input_ids.to(self.device)
        starts = torch.tensor([len(batch.prompt_ids[i]) for i in rows], device=self.device)
        token_slots = torch.full((input_ids.numel(),), slot, dtype=torch.long, device=self.device)
        with self.routing.route(token_slots):
            logits = self.model(input_ids=input_ids).logits.float()  # [B, L, V]
        token_logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
        # Response token j of a row sits at input position start + j and is predicted at start + j - 1.
        index = (starts[:, None] - 1 + torch.arange(response_len, device=self.device)[None]).clamp(max=seq_len - 2)
        return token_logprobs.gather(1, index)

    @torch.no_grad()
    def _adamw(self, slot_index: int, lr: float, step: int) -> float:
        """Clips the slot's gradients to ``max_grad_norm`` and applies one AdamW step to its fp32 masters,
        then writes the masters into the slot's LoRA parameters. Returns the pre-clip gradient norm."""
        slot = self.store.slots[slot_index]
        grads = {}
        for path, layer in self.layers.items():
            grads[f"{path}.a"] = layer.lora_a.grad[slot_index].float()
            grads[f"{path}.b"] = layer.lora_b.grad[slot_index].float()
        norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
        clip = min(1.0, self.optimizer.max_grad_norm / (float(norm) + 1e-6))
        beta1, beta2 = self.optimizer.betas
        for key, grad in grads.items():
            grad = grad * clip
            m, v, master = slot.exp_avg[key], slot.exp_avg_sq[key], slot.master[key]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v / (1 - beta2**step)).sqrt_().add_(self.optimizer.eps)
            master.mul_(1 - lr * self.optimizer.weight_decay)
            master.addcdiv_(m / (1 - beta1**step), denom, value=-lr)
        for path, layer in self.layers.items():
            layer.lora_a[slot_index].copy_(slot.master[f"{path}.a"])
            layer.lora_b[slot_index].copy_(slot.master[f"{path}.b"])
        return float(norm)


def _pad_float(values: list[list[float]], length: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(values), length, dtype=torch.float32)
    for i, row in enumerate(values):
        out[i, : len(row)] = torch.tensor(row[:length], dtype=torch.float32)
    return out.to(device)
