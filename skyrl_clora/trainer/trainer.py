"""The embedded trainer: GRPO steps for tenants swapped through the AdapterStore, one at a time (swap mode)
or several in one forward/backward (packed mode).

Advantages come from SkyRL's advantage-estimator registry and the loss from its policy-loss registry
(``skyrl.backends.skyrl_train.utils.ppo_utils``), configured by SkyRL's ``AlgorithmConfig``; the
optimizer is AdamW on each tenant's fp32 master weights with the tenant's own learning-rate schedule.
The PPO ratio's behaviour log-probs are the batch's ``old_logprobs`` when it has them (the Tinker-style
step passes the sampler's), else the update's own forward before the step (SkyRL's recomputed
``action_log_probs``). With ``use_kl_loss`` the loss adds SkyRL's KL term (``compute_approx_kl`` with
``kl_estimator_type``, each row's token mean averaged over the tenant's rows, times ``kl_loss_coef``)
against the reference policy: the frozen base model, i.e. the tenant's adapter disabled, no extra weights.
With ``use_kl_in_reward`` the pass first scores every row under the tenant's adapter and the reference, and
the advantages come from the rewards less SkyRL's KL penalty (``trainer.kl.kl_reward_penalty``) with the
coefficient of the tenant's own SkyRL KL controller (fixed or adaptive), whose value the tenant's state keeps.
Every policy log-prob (the update's, the behaviour scoring, the reward KL's policy side) is of the logits divided by
the tenant's temperature (``trainer.algorithm.temperature``, the sampling temperature unless set; see
``logprobs.training_temperature``), as SkyRL's policy forward computes them; the reference's are untempered, as
SkyRL's reference worker computes them.

A pass over ``P`` tenants in slots ``0..P-1``: every tenant's prompt groups are shuffled with the tenant's
own RNG (a group's rows stay together: a micro-batch computes each shared prompt once, see
``shared_prefix``), the tenants' row orders are interleaved group by group into micro-batches of ``micro_batch_size`` rows
routed to their tenants' slots, and per micro-batch the tenants' policy losses are summed and back-propagated once (the
packed LoRA op gives every slot its own gradients). Then each slot gets its own gradient clipping and
AdamW step with its tenant's learning rate and step count. Each tenant's loss normaliser covers its own
batch, so a tenant's update does not depend on which tenants shared its pass (up to float rounding).

With ``mini_batch_prompts`` (SkyRL's ``trainer.policy_mini_batch_size``) below a batch's prompt count, the above
is one optimizer step per mini-batch, as SkyRL's ``RayPPOTrainer._execute_training_step``: for each of
``update_epochs`` (``trainer.update_epochs_per_batch``) epochs, the tenant's mini-batches in batch order (never
shuffled; only the micro-batch order within one is), each its own loss normaliser, shuffle draw, gradient
clipping, AdamW step and LR-schedule step. Packed tenants take their ``k``-th steps in the same pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable

import torch
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry, compute_approx_kl
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.backends.skyrl_train.workers.worker_utils import reduce_metrics
from skyrl.train.config import AlgorithmConfig
from torch.profiler import record_function

from skyrl_clora.device.staging import lists_to_device
from skyrl_clora.kernels import LoRAMeta
from skyrl_clora.lora.layers import AdapterWeights, LoRARouting, MultiLoRALinear
from skyrl_clora.device.profiling import profiled
from skyrl_clora.trainer.adapter_store import AdapterStore, TenantState
from skyrl_clora.trainer.batch import MicroBatch, PassRows, TrainBatch, build_pass_rows, group_order, plan_micro_batches
from skyrl_clora.trainer.fused_modules import fuse_elementwise_modules
from skyrl_clora.trainer.kl import kl_reward_penalty, tenant_kl_controller
from skyrl_clora.trainer.logprobs import token_logprobs
from skyrl_clora.trainer.optim import OptimizerConfig, adamw_slot
from skyrl_clora.trainer.prompt_segments import segment_prefix_hidden
from skyrl_clora.trainer.shared_prefix import shared_prefix_hidden, supports_shared_prefix


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """How a :class:`Trainer` computes its steps, read from one run's configuration: SkyRL's ``algorithm`` settings
    (loss, advantage estimator, KL, temperature, mini-batches), AdamW's ``optimizer`` settings, and the shape of a
    pass (micro-batches, logits, fused modules, shared prompts, update epochs: :class:`Trainer` says what each
    does)."""

    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    micro_batch_size: int
    max_tokens_per_microbatch: int = -1
    max_logits: int = 1 << 27
    fused_elementwise: bool = True
    shared_prefix: bool = False
    mini_batch_prompts: int = 0
    update_epochs: int = 1

    def __post_init__(self) -> None:
        if self.update_epochs < 1:
            raise ValueError(f"update_epochs must be >= 1, got {self.update_epochs}")


class Trainer:
    """Runs GRPO steps on a trainer model whose LoRA layers are trainable slots managed by ``store``, as
    ``settings`` (:class:`TrainerSettings`) say.

    ``store.slots`` bounds the tenants of one packed pass; in swap mode a second slot, when there is one,
    receives the next tenant's state (``train_step(..., prefetch=name)``) while the current one trains.
    A pass's micro-batches hold ``micro_batch_size`` rows, or, with ``max_tokens_per_microbatch > 0`` (SkyRL's
    field of that name), as many rows as compute at most that many token positions (:func:`plan_micro_batches`):
    fewer, larger micro-batches cost fewer of the host's launches per pass. ``max_logits`` bounds the fp32
    logits alive at once (see :func:`token_logprobs`). With ``fused_elementwise`` the model's RMSNorm and
    SwiGLU MLP modules are replaced in place by fused ones (:func:`fuse_elementwise_modules`); without, the
    model's own modules run (bench_train's baseline).
    With ``shared_prefix`` (and a decoder of full-attention layers) the rows of a micro-batch that share a
    prompt compute it once: in one pass of prompt and response segments on a GPU in half precision
    (:func:`segment_prefix_hidden`), in a prompt pass and a response pass elsewhere (:func:`shared_prefix_hidden`);
    without, every row runs its whole sequence.
    """

    def __init__(self, model: torch.nn.Module, routing: LoRARouting, layers: dict[str, MultiLoRALinear],
                 store: AdapterStore, settings: TrainerSettings) -> None:
        if settings.fused_elementwise:
            fuse_elementwise_modules(model)
        self.model = model
        self.routing = routing
        self.layers = layers
        self.store = store
        self.algorithm = settings.algorithm  # SkyRL's worker sets its fields between steps (set_algorithm_config)
        self.optimizer = settings.optimizer
        self.micro_batch_size = settings.micro_batch_size
        self.max_tokens_per_microbatch = settings.max_tokens_per_microbatch
        self.mini_batch_prompts = settings.mini_batch_prompts
        self.update_epochs = settings.update_epochs
        self.max_logits = settings.max_logits
        self._policy_losses: dict[str, Callable] = {}  # SkyRL's policy losses by name (:meth:`_policy_loss`)
        self.device = store.device
        self.decoder = model.base_model
        self.head = model.get_output_embeddings()
        self.shared_prefix = settings.shared_prefix and supports_shared_prefix(self.decoder)
        # One flat pass on flash attention (a GPU in half precision; host-bound there, a second pass costs
        # what it saves), two passes elsewhere (the segments' reference attention is a dense [N, N] mask).
        flash = self.device.type == "cuda" and self.head.weight.dtype in (torch.float16, torch.bfloat16)
        self._prefix_hidden = segment_prefix_hidden if flash else shared_prefix_hidden

    def set_algorithm(self, algorithm: AlgorithmConfig) -> None:
        """Makes ``algorithm`` the config of the next steps and scorings (its policy loss, temperature, KL, ...) of
        tenants without their own."""
        self.algorithm = algorithm

    @property
    def pack_size(self) -> int:
        """The most tenants one packed pass trains (the store's device slots)."""
        return len(self.store.slots)

    def train_step(
        self, tenant: str, batch: TrainBatch, prefetch: str | None = None
    ) -> tuple[AdapterWeights, dict[str, float]]:
        """Swap mode: swaps ``tenant`` in, runs one policy update on ``batch``, swaps it out. With ``prefetch``
        (the tenant expected next) and a second device slot, that tenant's state is copied in meanwhile.

        Returns the tenant's new adapter weights (model dtype, for the sampler) and step metrics."""
        slot = self.store.slot_of(tenant)
        if slot is None:
            slot = self._free_slot(avoid=None)
        self.store.swap_in(tenant, slot)
        if prefetch is not None and prefetch != tenant and self.pack_size > 1 and self.store.slot_of(prefetch) is None:
            self.store.prefetch(prefetch, self._free_slot(avoid=slot))
        return self._train_swapped([(tenant, slot)], [batch])[0]

    def train_packed(self, items: list[tuple[str, TrainBatch]]) -> list[tuple[AdapterWeights, dict[str, float]]]:
        """Packed mode: trains every ``(tenant, batch)`` of ``items`` (distinct tenants, at most
        :attr:`pack_size`) in one pass; returns each tenant's new weights and metrics, in ``items`` order."""
        names = [name for name, _ in items]
        if not items or len(set(names)) != len(names):
            raise ValueError(f"train_packed needs distinct tenants, got {names}")
        if len(items) > self.pack_size:
            raise ValueError(f"{len(items)} tenants exceed the trainer's {self.pack_size} slots; raise clora.pack_size")
        for index, slot in enumerate(self.store.slots):  # prefetched swap-mode tenants give their slots back
            if slot.owner is not None and not slot.active:
                self.store.release(index)
        swapped = []
        try:
            for slot, name in enumerate(names):
                self.store.swap_in(name, slot)
                swapped.append((name, slot))
        except BaseException:
            for _, slot in swapped:
                self.store.swap_out(slot)
            raise
        return self._train_swapped(swapped, [batch for _, batch in items])

    def _free_slot(self, avoid: int | None) -> int:
        """A slot without a swapped-in tenant other than ``avoid``, freeing a prefetched tenant if needed."""
        candidates = [i for i, slot in enumerate(self.store.slots) if i != avoid and not slot.active]
        if not candidates:
            raise RuntimeError("no free trainer slot")
        free = next((i for i in candidates if self.store.slots[i].owner is None), candidates[0])
        if self.store.slots[free].owner is not None:
            self.store.release(free)
        return free

    def _train_swapped(
        self, swapped: list[tuple[str, int]], batches: list[TrainBatch]
    ) -> list[tuple[AdapterWeights, dict[str, float]]]:
        """One pass over swapped-in tenants ``(name, slot)``; swaps them out (also on error) and waits for
        their host states."""
        states = [self.store.tenants[name] for name, _ in swapped]
        try:
            metrics = self._update([slot for _, slot in swapped], states, batches)
        finally:
            for _, slot in swapped:
                self.store.swap_out(slot)
            for name, _ in swapped:
                self.store.wait(name)
        return [(state.weights, m) for state, m in zip(states, metrics)]

    def _update(self, slots: list[int], states: list[TenantState], batches: list[TrainBatch]) -> list[dict[str, float]]:
        """SkyRL's policy update of every tenant on its batch: ``update_epochs`` passes over the batch's mini-batches
        (in batch order), one AdamW step per mini-batch, each over the gradients of the tenant's policy loss on that
        mini-batch in shuffled, interleaved micro-batches. Advances each tenant's step count (one per optimizer
        step) and RNG state (one shuffle per optimizer step).

        The behaviour log-probs are the batch's ``old_logprobs`` when given; else, for a tenant taking one optimizer
        step, the step's own forward (the weights are still the pre-update ones); else one scoring pass before the
        first step (SkyRL's ``action_log_probs``, computed once per batch)."""
        algorithms = [state.algorithm or self.algorithm for state in states]
        rows = build_pass_rows(batches, slots, algorithms, self.device, mini_batch_prompts=self.mini_batch_prompts,
                               micro_batch_size=self.micro_batch_size)
        reward_kl, policy = None, None
        if self.algorithm.use_kl_in_reward:  # SkyRL's KL penalty in the reward, then the advantages again
            policy, base = self._pass_logprobs(rows, adapter=True), self._pass_logprobs(rows, adapter=False)
            parts = [slice(offset, offset + count) for offset, count in zip(rows.offsets, rows.counts)]
            penalties = []
            for state, part, algorithm in zip(states, parts, algorithms):  # each tenant's own SkyRL KL controller
                controller = tenant_kl_controller(algorithm, state.kl_coef)  # continued from its value
                penalties.append(kl_reward_penalty(policy[part], base[part], rows.response_mask[part], algorithm,
                                                   controller))
                state.kl_coef = float(controller.value)
            reward_kl = [kl_metrics for _, kl_metrics in penalties]
            rows = build_pass_rows(batches, slots, algorithms, self.device, [penalty for penalty, _ in penalties],
                                   self.mini_batch_prompts, self.micro_batch_size)
        minis = rows.mini_batches
        steps = [len(tenant_minis) * self.update_epochs for tenant_minis in minis]
        self._score_behaviour(rows, [count > 1 for count in steps], policy)
        generators = []
        for state in states:
            generator = torch.Generator().manual_seed(0)
            generator.set_state(state.rng_state)
            generators.append(generator)
        tenants = len(slots)
        # per optimizer step of the pass: policy loss, log-prob sum, |log-prob - sampler's|, KL, grad norm
        totals = torch.zeros(5, max(steps), tenants, device=self.device)
        taken: list[list[tuple[int, float]]] = [[] for _ in range(tenants)]  # per tenant: (pass step, its lr)
        step = 0
        for _ in range(self.update_epochs):
            for k in range(max(map(len, minis))):
                active = [p for p in range(tenants) if k < len(minis[p])]
                orders = [[] for _ in range(tenants)]
                for p in active:
                    local = minis[p][k]
                    groups = [rows.prompt_groups[rows.offsets[p] + row] for row in local]
                    orders[p] = [local[i] for i in group_order(groups, generators[p])]
                self._mini_batch_gradients(rows, slots, orders, algorithms, totals[:4, step])
                for p in active:
                    state = states[p]
                    state.step += 1
                    lr = state.schedule.lr(state.step - 1)
                    optimizer = self._tenant_optimizer(state)
                    totals[4, step, p] = adamw_slot(self.store, slots[p], lr, state.step, optimizer)
                    taken[p].append((step, lr))
                step += 1
        for state, generator in zip(states, generators):
            state.rng_state = generator.get_state()
        host = totals.tolist()  # the pass's one host synchronisation
        results = []
        for p in range(tenants):
            per_step = defaultdict(list)
            for s, lr in taken[p]:
                per_step["policy_loss"].append(host[0][s][p])
                per_step["grad_norm"].append(host[4][s][p])
                per_step["lr"].append(lr)
                if self.algorithm.use_kl_loss:
                    per_step["policy_kl"].append(host[3][s][p])
            metrics = reduce_metrics(per_step)  # SkyRL's reduction over a step's mini-batches: the mean
            tokens = max(1.0, rows.response_tokens[p]) * self.update_epochs
            metrics.update(response_tokens=rows.response_tokens[p], optimizer_steps=float(steps[p]),
                           mean_token_logprob=sum(host[1][s][p] for s, _ in taken[p]) / tokens)
            if rows.has_rollout[p]:
                metrics["logprob_abs_diff_vs_sampler"] = sum(host[2][s][p] for s, _ in taken[p]) / tokens
            if reward_kl is not None:
                metrics.update(reward_kl[p])
            results.append(metrics)
        return results

    def _policy_loss(self, name: str) -> Callable:
        """SkyRL's policy loss ``name``, looked up in its registry once per trainer (with Ray running, a lookup
        syncs with the registry's actor: a round trip per call)."""
        if name not in self._policy_losses:
            self._policy_losses[name] = PolicyLossRegistry.get(name)
        return self._policy_losses[name]

    def _tenant_optimizer(self, state: TenantState) -> OptimizerConfig:
        """The trainer's AdamW settings with the tenant's own ``weight_decay`` and ``max_grad_norm`` where it has them."""
        own = {name: getattr(state, name) for name in ("weight_decay", "max_grad_norm") if getattr(state, name) is not None}
        return dataclasses.replace(self.optimizer, **own) if own else self.optimizer

    def _score_behaviour(self, rows: PassRows, needed: list[bool], policy: torch.Tensor | None) -> None:
        """Makes ``rows.old_logprobs`` hold, for each tenant ``p`` with ``needed[p]`` and no log-probs of its own,
        its pre-update policy's log-probs (``policy`` when given, else one scoring pass), and marks them given."""
        wanted = [need and not given for need, given in zip(needed, rows.has_old or [False] * len(needed))]
        if not any(wanted):
            return
        scored = policy if policy is not None else self._pass_logprobs(rows, adapter=True)
        old = rows.old_logprobs if rows.old_logprobs is not None else torch.zeros_like(scored)
        for p, want in enumerate(wanted):
            if want:
                part = slice(rows.offsets[p], rows.offsets[p] + rows.counts[p])
                old[part] = scored[part]
        rows.old_logprobs = old
        rows.has_old = [given or want for given, want in zip(rows.has_old or [False] * len(wanted), wanted)]

    def _mini_batch_gradients(self, rows: PassRows, slots: list[int], orders: list[list[int]],
                              algorithms: list[AlgorithmConfig], totals: torch.Tensor) -> None:
        """Zeroes the gradients of the slots of the tenants with rows in ``orders`` (``orders[p]``: tenant ``p``'s
        rows of this mini-batch, local indices in shuffled order; empty: the tenant takes no step now) and
        accumulates their policy losses' gradients (each with its tenant's ``algorithms[p]``) over micro-batches; adds
        per tenant into ``totals [4, P]``:
        policy loss, log-prob sum, |log-prob - sampler's| sum and KL."""
        order, micro_batches = self._plan(rows, orders)
        order_device = lists_to_device([order], self.device)[0]
        torch._foreach_zero_([view for p, slot in enumerate(slots) if orders[p]
                              for view in self.store.param_views(slot, grads=True)])
        counts = [len(tenant_order) for tenant_order in orders]
        kl_loss = self.algorithm.use_kl_loss
        for micro in micro_batches:
            host_rows = order[micro.start : micro.end]
            row_index = order_device[micro.start : micro.end]
            width = micro.response_width
            reference = self._reference_logprobs(rows, row_index, micro, host_rows) if kl_loss else None
            log_probs = self._logprobs(rows, row_index, micro, host_rows)
            advantages = rows.advantages[row_index, :width]
            mask = rows.response_mask[row_index, :width]
            rollout = rows.rollout_logprobs[row_index, :width]
            old = rows.old_logprobs[row_index, :width] if rows.old_logprobs is not None else None
            loss_sum = None
            for tenant, first, last in micro.segments:
                part = slice(first, last)
                detached = log_probs[part].detach()
                # The behaviour policy's log-probs: given (or scored before the first step), or this forward's (one
                # optimizer step per RL step: the weights are still the pre-update ones).
                behaviour = old[part] if rows.has_old[tenant] else detached
                algorithm = algorithms[tenant]
                loss, _ = self._policy_loss(algorithm.policy_loss_type)(
                    log_probs[part], behaviour, advantages[part], config=algorithm,
                    loss_mask=mask[part], rollout_logprobs=rollout[part] if rows.has_rollout[tenant] else None,
                )
                totals[0, tenant] += loss.detach()
                if reference is not None:  # SkyRL's KL loss: each row's token mean, averaged over the mini-batch's rows
                    kl = compute_approx_kl(log_probs[part], reference[part], loss_mask=mask[part],
                                           kl_estimator_type=algorithm.kl_estimator_type)
                    kl = masked_mean(kl, mask[part], dim=-1).sum() / counts[tenant]
                    totals[3, tenant] += kl.detach()
                    loss = loss + kl * algorithm.kl_loss_coef
                loss_sum = loss if loss_sum is None else loss_sum + loss
                totals[1, tenant] += (detached * mask[part]).sum()
                totals[2, tenant] += ((detached - rollout[part]).abs() * mask[part]).sum()
            with record_function("trainer.backward"):
                loss_sum.backward()

    def _plan(self, rows: PassRows, orders: list[list[int]]) -> tuple[list[int], list[MicroBatch]]:
        """The pass's row order and micro-batches (:func:`plan_micro_batches` under this trainer's bounds)."""
        return plan_micro_batches(rows, orders, self.micro_batch_size, self.max_tokens_per_microbatch, self.shared_prefix)

    @torch.no_grad()
    def _reference_logprobs(self, rows: PassRows, row_index: torch.Tensor, micro: MicroBatch,
                            host_rows: list[int]) -> torch.Tensor:
        """The reference policy's log-probs ``[B, response_width]`` of a micro-batch's rows for SkyRL's KL loss:
        the batch's ``ref_logprobs`` where its tenant gave them, else the frozen base model's (a LoRA tenant's
        reference is its adapter disabled)."""
        width = micro.response_width
        given = rows.has_ref or [False] * len(rows.counts)
        if all(given[tenant] for tenant, _, _ in micro.segments):
            return rows.ref_logprobs[row_index, :width]
        reference = self._logprobs(rows, row_index, micro, host_rows, adapter=False)
        for tenant, first, last in micro.segments:
            if given[tenant]:
                reference[first:last] = rows.ref_logprobs[row_index[first:last], :width]
        return reference

    @profiled("trainer.forward")
    def _logprobs(self, rows: PassRows, row_index: torch.Tensor, micro: MicroBatch, host_rows: list[int],
                  adapter: bool = True, tempered: bool | None = None) -> torch.Tensor:
        """Log-probs ``[B, response_width]`` of the response tokens of rows ``row_index`` (``host_rows`` on the
        host), each under its tenant's slot at its tenant's temperature (``rows.temperature``: logits / T, as SkyRL's
        policy forward), or under the base model alone at temperature 1 without ``adapter`` (SkyRL's reference
        forward; positions past a row's response hold a clamped token's log-prob; masks drop them). ``tempered``
        (None: ``adapter``) says whether ``rows.temperature`` applies. Rows that share a prompt compute it once (see
        the class docstring)."""
        width = micro.width
        input_ids = rows.input_ids[row_index, :width]
        steps = torch.arange(micro.response_width, device=self.device)
        slots = {rows.host_row_slot[row] for row in host_rows}
        single_slot = slots.pop() if len(slots) == 1 else None
        if adapter:
            route = functools.partial(self._route, single_slot=single_slot)
        else:
            def route(token_slots: torch.Tensor) -> contextlib.AbstractContextManager:
                return self.routing.route(None)
        prefix_of: dict[int, int] = {}  # prompt group -> its index among the micro-batch's distinct prompts
        if self.shared_prefix:
            for row in host_rows:
                prefix_of.setdefault(rows.prompt_groups[row], len(prefix_of))
        if self.shared_prefix and len(prefix_of) < len(host_rows):  # some rows share a prompt
            hidden = self._prefix_hidden(
                self.decoder, route, input_ids,
                prompt_lens=[rows.host_seq_lens[r] - rows.host_response_lens[r] for r in host_rows],
                response_lens=[rows.host_response_lens[r] for r in host_rows],
                row_slots=[rows.host_row_slot[r] for r in host_rows],
                prefix_of=[prefix_of[rows.prompt_groups[r]] for r in host_rows], response_width=micro.response_width,
            )
        else:
            positions = torch.arange(width, device=self.device)
            token_slots = torch.where(positions[None] < rows.seq_lens[row_index, None], rows.row_slot[row_index, None], -1)
            with route(token_slots.reshape(-1)):
                full = self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, L, H]
            # Response token j of a row sits at input position start + j and is predicted at start + j - 1.
            index = (rows.prompt_lens[row_index, None] - 1 + steps[None]).clamp(0, max(width - 2, 0))
            hidden = full.gather(1, index[..., None].expand(-1, -1, full.shape[-1]))
        targets = input_ids.gather(1, (rows.prompt_lens[row_index, None] + steps[None]).clamp(max=width - 1))
        temperature = None  # the reference (no adapter) is untempered, as SkyRL's ref worker's forward
        if (adapter if tempered is None else tempered) and rows.temperature is not None:
            temperature = rows.temperature[row_index, None].expand(targets.shape).reshape(-1)
        log_probs = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.head, targets.reshape(-1), self.max_logits,
                                   temperature)
        return log_probs.view(targets.shape)

    def _route(self, token_slots: torch.Tensor, single_slot: int | None = None) -> contextlib.AbstractContextManager:
        """Routes a pass's flattened tokens ``[T]`` to their slots. With ``single_slot`` (the slot of every row of
        the micro-batch; tokens at -1 are right padding) the layers run one dense LoRA over all tokens: padding
        reaches no real position (causal attention, or masked prompt keys) and its log-probs are masked, so the
        loss and its gradients are those of the routed form. Otherwise the kernels' row grouping is built
        once for every layer of the pass on a GPU."""
        meta = None
        if token_slots.is_cuda and single_slot is None:
            lora_a = next(iter(self.layers.values())).lora_a
            meta = LoRAMeta.for_batch(token_slots, lora_a.shape[0], lora_a.shape[1], max_slices=1)
        return self.routing.route(token_slots, meta, single_slot)

    @torch.no_grad()
    def response_logprobs(self, tenant: str | None, batch: TrainBatch, temperature: float | None = None) -> torch.Tensor:
        """Log-probs ``[N, Lr]`` (fp32, device) of ``batch``'s response tokens under ``tenant``'s current
        adapter, or under the base model alone (the adapter disabled) when ``tenant`` is None, in row order;
        ``Lr`` = the longest response, 0 past each row's response. The logits are divided by ``temperature`` when
        given (1: none), else by the tenant's temperature (the base model: none). The tenant's state is left
        unchanged."""
        slot = self._free_slot(avoid=None)
        if tenant is not None:
            self.store.swap_in(tenant, slot)
        try:
            state = self.store.tenants[tenant] if tenant is not None else None
            algorithm = state.algorithm or self.algorithm if state is not None else self.algorithm
            if temperature is not None:
                algorithm = dataclasses.replace(algorithm, temperature=temperature)
            rows = build_pass_rows([batch], [slot], algorithm, self.device, micro_batch_size=self.micro_batch_size)
            return self._pass_logprobs(rows, adapter=tenant is not None,
                                       tempered=tenant is not None or temperature is not None)
        finally:
            if tenant is not None:
                self.store.swap_out(slot)
                self.store.wait(tenant)

    @torch.no_grad()
    def _pass_logprobs(self, rows: PassRows, adapter: bool, tempered: bool | None = None) -> torch.Tensor:
        """Log-probs ``[R, Lr]`` of every row's response tokens, in row order, each under its tenant's slot (the
        tenants swapped in) or, without ``adapter``, under the base model alone; 0 past each row's response.
        ``tempered``: at ``rows.temperature`` (None: when ``adapter``; see :meth:`_logprobs`)."""
        order, micro_batches = self._plan(rows, [list(range(count)) for count in rows.counts])
        order_device = lists_to_device([order], self.device)[0]
        out = torch.zeros_like(rows.response_mask)
        for micro in micro_batches:
            row_index = order_device[micro.start : micro.end]
            out[row_index, : micro.response_width] = self._logprobs(
                rows, row_index, micro, order[micro.start : micro.end], adapter=adapter, tempered=tempered)
        lengths = lists_to_device([rows.host_response_lens], self.device)[0]
        return out.masked_fill(torch.arange(out.shape[1], device=self.device)[None] >= lengths[:, None], 0.0)
