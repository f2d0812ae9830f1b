"""Tinker's training calls on the embedded trainer: each Tinker model is a tenant of the
:class:`~skyrl_clora.trainer.adapter_store.AdapterStore` (its LoRA masters, Adam moments, accumulated gradients and
optimizer step in host memory), swapped into the trainer's device slot 0 for its calls.

- :meth:`TinkerTrainer.pass_datums`: the target tokens' log-probs of a model's datums (logits at temperature 1, as
  Tinker's), each datum's elementwise loss (:func:`~skyrl_clora.tinker.losses.elementwise_loss`) and, with
  ``backward``, the gradient of their summed loss added to the model's gradients (kept across calls, swaps included,
  until :meth:`optim_step`). Datums run right-padded in micro-batches of at most ``micro_batch_tokens`` positions.
- :meth:`TinkerTrainer.optim_step`: one AdamW step with the call's settings (learning rate, betas, eps, weight decay;
  no gradient clipping, as SkyRL's server drops Tinker's ``grad_clip_norm``), then the gradients are zeroed.
- :meth:`TinkerTrainer.host_weights`: the model's adapter in the model dtype, host memory (what the sampler gets).
- :meth:`TinkerTrainer.prompt_logprobs`: the log-prob of each prompt token after the first under given adapter
  weights (a sampler checkpoint's, loaded into a scratch tenant in the last device slot) or the base model alone.

The slot stays with its model after a call (consecutive calls of one model swap nothing); another model's call swaps
it out first. Calls may come from several threads (the Tinker engine's and its sampler's): each public method holds
the trainer's lock.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

from skyrl_clora.lora.layers import AdapterWeights
from skyrl_clora.lora.peft_export import init_adapter
from skyrl_clora.tinker.losses import elementwise_loss
from skyrl_clora.trainer.logprobs import token_logprobs
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.optim import OptimizerConfig, adamw_slot
from skyrl_clora.trainer.state_io import read_tenant_state, write_tenant_state
from skyrl_clora.trainer.trainer import Trainer

SLOT = 0  # the device slot Tinker models train in
SCRATCH = "clora-tinker-scoring"  # the scratch tenant :meth:`TinkerTrainer.prompt_logprobs` scores with
P = ParamSpec("P")
R = TypeVar("R")


def _locked(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` of :class:`TinkerTrainer` run holding the trainer's lock."""
    @functools.wraps(method)
    def run(self: "TinkerTrainer", *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


@dataclass
class Datum:
    """One Tinker datum: ``tokens`` (the model input, ``N`` positions) and per position its ``targets`` (the token
    position ``i`` predicts), ``weights``, and for the sampling losses the sampler's ``sampling_logprobs`` and the
    ``advantages`` (None when not sent)."""

    tokens: list[int]
    targets: list[int]
    weights: list[float]
    sampling_logprobs: list[float] | None = None
    advantages: list[float] | None = None


@dataclass
class DatumResult:
    """One datum's target log-probs and elementwise loss, ``[N]`` fp32 on the host."""

    logprobs: torch.Tensor
    loss: torch.Tensor


class TinkerTrainer:
    """Tinker models as tenants of ``trainer``'s AdapterStore (module docstring)."""

    def __init__(self, trainer: Trainer, micro_batch_tokens: int) -> None:
        self.trainer = trainer
        self.store = trainer.store
        self.micro_batch_tokens = micro_batch_tokens
        self.live: str | None = None  # the model in SLOT
        self.lock = threading.RLock()

    @_locked
    def create(self, model_id: str, rank: int, alpha: float, seed: int) -> AdapterWeights:
        """Registers ``model_id`` with PEFT's initial adapter drawn from ``seed`` (B = 0: the base model's outputs);
        returns that adapter (fp32) for the sampler."""
        weights = init_adapter(self.trainer.layers, rank, alpha, torch.Generator().manual_seed(seed))
        # Tinker sends the learning rate with every optim_step: the store's schedule is never read for these tenants
        self.store.register(model_id, weights, LRSchedule(base_lr=1.0), seed=seed)
        return weights

    @_locked
    def delete(self, model_id: str) -> None:
        self._leave(model_id)
        self.store.remove(model_id)

    @_locked
    def pass_datums(self, model_id: str, datums: list[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None,
                    backward: bool) -> list[DatumResult]:
        """Each datum's result (module docstring), in order; with ``backward`` the summed loss's gradient is added to
        ``model_id``'s gradients."""
        for datum in datums:
            if not (len(datum.tokens) == len(datum.targets) == len(datum.weights)) or not datum.tokens:
                raise ValueError(f"a datum needs as many target tokens and weights as input tokens (got "
                                 f"{len(datum.tokens)}, {len(datum.targets)}, {len(datum.weights)})")
        self._enter(model_id)
        results: list[DatumResult] = []
        for batch in self._micro_batches(datums):
            with torch.enable_grad() if backward else torch.no_grad():
                logprobs = self._logprobs(batch, SLOT)
                losses = [elementwise_loss(loss_fn, lp, self._tensor(d.weights), self._optional(d.sampling_logprobs),
                                           self._optional(d.advantages), loss_fn_config)
                          for lp, d in zip(logprobs, batch)]
                if backward:
                    torch.stack([loss.sum() for loss in losses]).sum().backward()
            results += [DatumResult(lp.detach().float().cpu(), loss.detach().float().cpu())
                        for lp, loss in zip(logprobs, losses)]
        return results

    @_locked
    def optim_step(self, model_id: str, learning_rate: float, betas: tuple[float, float], eps: float,
                   weight_decay: float) -> float:
        """One AdamW step of ``model_id`` on its accumulated gradients; returns their norm."""
        self._enter(model_id)
        state = self.store.tenants[model_id]
        config = OptimizerConfig(betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=math.inf)
        norm = adamw_slot(self.store, SLOT, learning_rate, state.step + 1, config)
        state.step += 1
        with torch.no_grad():
            torch._foreach_zero_(self.store.param_views(SLOT, grads=True))
        return float(norm)

    @_locked
    def host_weights(self, model_id: str) -> AdapterWeights:
        """``model_id``'s current adapter (model dtype, host memory; a fresh object each swap-out)."""
        self._leave(model_id)
        self.store.wait(model_id)
        return self.store.tenants[model_id].weights

    @_locked
    @torch.no_grad()
    def prompt_logprobs(self, weights: AdapterWeights | None, prompts: list[list[int]]) -> list[list[float]]:
        """Per prompt, ``log p(token_i | tokens_<i)`` for ``i >= 1`` (fp32, temperature 1) under ``weights`` (exactly,
        as a tenant holding them: masters cast to the model dtype) or, for None, the base model alone."""
        if any(len(prompt) < 2 for prompt in prompts):
            raise ValueError("prompt log-probs need prompts of at least 2 tokens")
        slot = len(self.store.slots) - 1
        if weights is not None:
            if slot == SLOT:
                self._leave(self.live)
            self.store.register(SCRATCH, weights, LRSchedule(base_lr=1.0), seed=0)
            self.store.swap_in(SCRATCH, slot)
        try:
            datums = [Datum(prompt[:-1], prompt[1:], [1.0] * (len(prompt) - 1)) for prompt in prompts]
            return [values.float().cpu().tolist() for batch in self._micro_batches(datums)
                    for values in self._logprobs(batch, slot if weights is not None else None)]
        finally:
            if weights is not None:
                self.store.swap_out(slot)
                self.store.remove(SCRATCH)

    @_locked
    def save_state(self, model_id: str, folder: Path) -> None:
        """``model_id``'s training state (masters, moments, gradients, step) into ``folder``."""
        self._leave(model_id)
        folder.mkdir(parents=True, exist_ok=True)
        write_tenant_state(self.store, model_id, folder)

    @_locked
    def load_state(self, model_id: str, folder: Path, with_optimizer: bool) -> None:
        """``folder``'s state into ``model_id`` (same rank and layers); without ``with_optimizer`` only the weights:
        moments, gradients and the step count start from zero."""
        self._leave(model_id)
        read_tenant_state(self.store, model_id, folder)
        if not with_optimizer:
            state = self.store.tenants[model_id]
            for table in ("exp_avg", "exp_avg_sq", "grads"):
                state.flat[table].zero_()
            state.step = 0

    # ---- helpers ------------------------------------------------------------------------------------
    def _enter(self, model_id: str) -> None:
        if self.live == model_id:
            return
        if model_id not in self.store.tenants:
            raise ValueError(f"model {model_id!r} does not exist on this server")
        if self.live is not None:
            self.store.swap_out(SLOT)
        self.live = None
        self.store.swap_in(model_id, SLOT)
        self.live = model_id

    def _leave(self, model_id: str | None) -> None:
        if model_id is not None and self.live == model_id:
            self.store.swap_out(SLOT)
            self.live = None

    def _micro_batches(self, datums: list[Datum]) -> list[list[Datum]]:
        """Consecutive datums, each batch's padded positions (rows x longest) at most ``micro_batch_tokens`` (a longer
        datum runs alone)."""
        batches: list[list[Datum]] = []
        for datum in datums:
            if batches:
                batch = batches[-1]
                longest = max(len(datum.tokens), *(len(d.tokens) for d in batch))
                if (len(batch) + 1) * longest <= self.micro_batch_tokens:
                    batch.append(datum)
                    continue
            batches.append([datum])
        return batches

    def _logprobs(self, batch: list[Datum], slot: int | None) -> list[torch.Tensor]:
        """Each datum's ``[N]`` fp32 log-probs of its targets under ``slot``'s adapter (None: the base model alone):
        one right-padded forward (causal attention: padding on the right never reaches a real position)."""
        device, lengths = self.store.device, [len(d.tokens) for d in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        for row, datum in enumerate(batch):
            ids[row, : lengths[row]] = torch.tensor(datum.tokens)
        ids = ids.to(device)
        token_slots = None if slot is None else torch.full((ids.numel(),), slot, device=device, dtype=torch.long)
        with self.trainer.routing.route(token_slots, None, slot):
            hidden = self.trainer.decoder(input_ids=ids, use_cache=False).last_hidden_state
        real = torch.cat([hidden[row, :length] for row, length in enumerate(lengths)])
        targets = torch.tensor([t for d in batch for t in d.targets], device=device, dtype=torch.long)
        logprobs = token_logprobs(real, self.trainer.head, targets, self.trainer.max_logits)
        return list(logprobs.split(lengths))

    def _tensor(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.store.device)

    def _optional(self, values: list[float] | None) -> torch.Tensor | None:
        return None if values is None else self._tensor(values)
