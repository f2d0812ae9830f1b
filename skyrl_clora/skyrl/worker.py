"""SkyRL's policy-worker API over the embedded trainer, as a Ray actor that ``WorkerDispatch`` drives.

On a GPU cluster SkyRL's ``WorkerDispatch`` sends each tenant's calls (``model_id=<tenant>``) through a
``PPORayActorGroup`` to Megatron policy workers and their ``AdapterStore``. :class:`EmbeddedPolicyWorker`
is the stand-in when Megatron is absent (``backend.strategy=embedded``): a Ray actor (world size 1, built
by SkyRL's own ``PPORayActorGroup`` with ``num_gpus_per_actor=0``) that answers the methods
``WorkerDispatch`` calls, over :class:`~skyrl_clora.trainer.trainer.Trainer` and its
:class:`~skyrl_clora.trainer.adapter_store.AdapterStore`. The model weights load inside the actor.

===================================  ==============================================================
``WorkerDispatch`` call              what this worker does
===================================  ==============================================================
``register_adapter("policy", t)``    registers tenant ``t`` in the AdapterStore: a PEFT-style init
                                     seeded with the tenant's seed, its own LR schedule and RNG
``delete_adapter("policy", t)``      removes the tenant's state
``save_tenant_state(t, folder)``,    (called by the skyrl driver through the actor group) a tenant's
``load_tenant_state(t, folder)``     checkpoint: its training state to or from ``folder``
``ensure_active_adapter`` ->         makes ``t`` the tenant the next ``forward_backward`` /
``swap_to_adapter(t)``               ``optim_step`` / sync act on
``forward(data)``                    the response log-probs of ``data``'s rows under the active
                                     adapter (SkyRL's recomputed ``action_log_probs``), or under the
                                     base model alone for ``REFERENCE_MODEL_ID`` (the KL reference),
                                     at ``cfg.algorithm.temperature`` for either, as SkyRL's policy
                                     workers (the driver sets 1 for the reference, as SkyRL's ref worker)
``set_algorithm_config(**kw)``       SkyRL's ``Worker.set_algorithm_config``: sets ``cfg.algorithm``'s
                                     fields, which the next forwards and updates use
``forward_backward(data)``           stages the ``TrainingInputBatch`` (see below) for the tenant
``optim_step()``                     one GRPO update of the tenant over everything staged since its
                                     last step (``Trainer.train_step``: forward, backward, AdamW at
                                     the tenant's scheduled LR); returns the pre-clip gradient norm
``save_weights_for_sampler`` ->      writes the tenant's adapter as a PEFT folder under
``broadcast_to_inference_engines``   ``lora_sync_path/<t>`` and loads it in place on every inference
                                     server under its own name (SkyRL's disk path); no pause and no
                                     prefix-cache reset
===================================  ==============================================================

Why ``forward_backward`` stages: the embedded Trainer fuses forward, backward and the optimizer step in
``Trainer.train_step(tenant, batch)``, so the gradient is taken at ``optim_step`` over the rows staged since the
tenant's last step together: SkyRL's accumulate-then-step over one mini-batch (the skyrl driver sends one
``forward_backward`` per mini-batch, then ``optim_step``, as ``RayPPOTrainer._execute_training_step``). The
step's metrics (policy loss, LR, ...) are returned by :meth:`step_metrics`.

``data`` is the batch SkyRL's ``RayPPOTrainer.convert_to_training_input`` builds (``sequences``,
``attention_mask``, ``response_mask``, ``loss_mask``, ``rewards``, ``rollout_logprobs``, right-aligned
response tensors from ``convert_prompts_responses_to_batch_tensors``) with ``metadata["uids"]`` naming
each row's GRPO group, and the ``advantages`` SkyRL's policy workers read (the driver's, already scaled by the loss
reduction for this mini-batch; without them the Trainer computes them from rewards and groups).
``action_log_probs`` (the behaviour policy's: recomputed by :meth:`forward`, or the sampler's in the Tinker-style
step) and ``base_action_log_probs`` (the reference's, for SkyRL's KL loss), when present, are what the update reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import torch
from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank, WorkerOutput
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.config import TrainerConfig
from transformers import AutoModelForCausalLM

from skyrl_clora.lora.layers import attach_multi_lora
from skyrl_clora.lora.peft_export import init_adapter, save_peft_adapter
from skyrl_clora.trainer.adapter_store import AdapterStore
from skyrl_clora.trainer.logprobs import training_temperature
from skyrl_clora.trainer.lr_schedule import LRSchedule
from skyrl_clora.trainer.state_io import read_tenant_state, write_tenant_state
from skyrl_clora.trainer.trainer import OptimizerConfig, TrainBatch, Trainer, TrainerSettings


# The model_id under which the policy worker answers ``forward`` with the reference policy: the frozen base,
# i.e. a tenant's adapter disabled (SkyRL's KL loss). The embedded worker routes no adapter; on Megatron it is an
# adapter registered from the pristine slot and never trained (LoRA B = 0: the base model's outputs exactly).
# ':' is no character of a tenant name.
REFERENCE_MODEL_ID = "clora:reference"

# SkyRL's per-token tensors of a training batch -> the TrainBatch fields they fill (right-aligned, see below).
_PER_TOKEN = {"rollout_logprobs": "rollout_logprobs", "action_log_probs": "old_logprobs",
              "base_action_log_probs": "ref_logprobs", "advantages": "advantages"}


def training_batch_to_train_batch(data: TrainingInputBatch) -> TrainBatch:
    """Inverts ``convert_prompts_responses_to_batch_tensors`` row by row into the Trainer's batch.

    Row ``i``: its real tokens are ``sequences[i][attention_mask[i] == 1]``, the last
    ``response_mask[i].sum()`` of them are the response; response tensors are right-aligned, so the
    loss mask and the per-token tensors present (``rollout_logprobs``; ``action_log_probs``, the behaviour
    policy's, as ``old_logprobs``; ``base_action_log_probs``, the reference's, as ``ref_logprobs``;
    ``advantages``, final) are their last ``len(response)`` entries; the reward is the sum of the row's token-level rewards; its group is
    ``metadata["uids"][i]``."""
    uids = (data.metadata or {}).get("uids")
    rows = data["sequences"].shape[0]
    if uids is None or len(uids) != rows:
        raise ValueError(f"forward_backward needs metadata['uids'] with one group id per row ({rows} rows)")
    prompt_ids, response_ids, loss_masks, rewards = [], [], [], []
    present = {key: data[key] for key in _PER_TOKEN if key in data.keys() and data[key] is not None}
    per_token: dict[str, list[list[float]]] = {key: [] for key in present}
    for i in range(rows):
        tokens = data["sequences"][i][data["attention_mask"][i].bool()].tolist()
        length = int(data["response_mask"][i].sum())
        if length < 1 or length > len(tokens):
            raise ValueError(f"row {i}: response length {length} does not fit its {len(tokens)} tokens")
        prompt_ids.append(tokens[:-length])
        response_ids.append(tokens[-length:])
        loss_masks.append([int(m) for m in data["loss_mask"][i, -length:].tolist()])
        rewards.append(float(data["rewards"][i].sum()))
        for key, table in present.items():
            per_token[key].append(table[i, -length:].tolist())
    return TrainBatch(prompt_ids=prompt_ids, response_ids=response_ids, loss_masks=loss_masks, rewards=rewards,
                      group_ids=[str(u) for u in uids],
                      **{field: per_token.get(key) for key, field in _PER_TOKEN.items()})


def forward_batch(data: TrainingInputBatch) -> TrainBatch:
    """The batch whose response log-probs SkyRL's policy ``forward`` returns: per row, the last
    ``metadata["response_length"]`` of its real tokens (all but the first when it has no more), as SkyRL's model
    computes ``log_probs[:, -num_actions - 1 : -1]`` over the left-padded sequence (masks drop the positions
    that are no response). No rewards or groups: nothing is trained on it."""
    width = int((data.metadata or {})["response_length"])
    prompt_ids, response_ids = [], []
    for i in range(data["sequences"].shape[0]):
        tokens = data["sequences"][i][data["attention_mask"][i].bool()].tolist()
        length = min(width, len(tokens) - 1)
        if length < 1:
            raise ValueError(f"row {i}: {len(tokens)} real tokens leave no response to score")
        prompt_ids.append(tokens[:-length])
        response_ids.append(tokens[-length:])
    rows = len(response_ids)
    return TrainBatch(prompt_ids=prompt_ids, response_ids=response_ids, loss_masks=[[1] * len(r) for r in response_ids],
                      rewards=[0.0] * rows, group_ids=[str(i) for i in range(rows)], rollout_logprobs=None)


class EmbeddedPolicyWorker:
    """The policy worker (see module docstring). Wrap with ``ray.remote`` and hand the class to SkyRL's
    ``PPORayActorGroup``; the constructor takes the keyword arguments that group passes."""

    def __init__(self, cfg: TrainerConfig, world_size: int, rank: int, local_rank: int, master_addr: Any,
                 master_port: Any, sequence_parallel_size: int = 1, record_memory: bool = False) -> None:
        if world_size != 1 or sequence_parallel_size != 1:
            raise ValueError("the embedded policy worker runs as one process: set policy_num_nodes=1, "
                             "policy_num_gpus_per_node=1 and sequence_parallel_size=1")
        if record_memory:
            raise ValueError("record_memory needs CUDA memory snapshots; the embedded worker runs on the CPU")
        self.cfg = cfg
        self.trainer: Trainer | None = None
        self.store: AdapterStore | None = None
        self.tenants: dict[str, dict[str, float]] = {}
        self.active: str | None = None
        self.staged: dict[str, list[TrainBatch]] = {}
        self.last_metrics: dict[str, dict[str, float]] = {}
        self.total_steps = 1
        self._client: Any = None

    # ---- what PPORayActorGroup calls while building the group -----------------------------------

    def init_worker_process_group(self) -> None:
        """Nothing to join: one process, no collectives."""

    def get_mesh_rank(self) -> MeshRank:
        return MeshRank(dp=0, sp=0, tp=0, pp=0, world_size=1, dp_size=1, pp_size=1)

    def init_model(self, model_path: str, num_training_steps: Optional[int] = None,
                   tenants: Optional[dict[str, dict[str, float]]] = None, max_rank: int = 16, threads: int = 1) -> None:
        """Loads the base model and builds the Trainer with one trainable slot.

        ``tenants`` maps each tenant that may be registered to its ``{"seed", "lr", "rank", "alpha"}``
        (from its translated SkyRL config); ``num_training_steps`` is the LR schedules' horizon."""
        torch.set_num_threads(threads)
        policy = self.cfg.policy
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
        routing, layers = attach_multi_lora(model, 1, max_rank, trainable=True)
        self.store = AdapterStore(layers, num_slots=1)
        optimizer = policy.optimizer_config
        settings = TrainerSettings(
            self._trainer_algorithm(),
            OptimizerConfig(betas=tuple(optimizer.adam_betas), weight_decay=optimizer.weight_decay,
                            max_grad_norm=optimizer.max_grad_norm),
            micro_batch_size=self.cfg.micro_train_batch_size_per_gpu,
            max_tokens_per_microbatch=self.cfg.max_tokens_per_microbatch,
        )
        self.trainer = Trainer(model, routing, layers, self.store, settings)
        self.tenants = dict(tenants or {})
        self.total_steps = max(1, num_training_steps or 1)

    def set_algorithm_config(self, **kwargs: Any) -> None:
        """SkyRL's ``Worker.set_algorithm_config`` (``WorkerDispatch.set_algorithm_config`` sends it through
        ``pass_through``): sets each field of ``cfg.algorithm``; the next :meth:`forward`, :meth:`forward_backward`
        and :meth:`optim_step` use the new values."""
        for key, value in kwargs.items():
            if not hasattr(self.cfg.algorithm, key):
                raise ValueError(f"set_algorithm_config: trainer.algorithm has no field {key!r}")
            setattr(self.cfg.algorithm, key, value)
        if self.trainer is not None:
            self.trainer.set_algorithm(self._trainer_algorithm())

    def _trainer_algorithm(self) -> Any:
        """``cfg.algorithm`` as the embedded Trainer takes it: without the KL penalty in the reward, which is the
        driver's (SkyRL's trainer applies it before the workers' update)."""
        return dataclasses.replace(self.cfg.algorithm, use_kl_in_reward=False)

    def _set_pad_token_id(self, pad_token_id: int) -> None:
        """SkyRL's trainer sets this after ``init_model``; padding never reaches the embedded Trainer
        (rows are unpadded in :func:`training_batch_to_train_batch`)."""

    # ---- adapter store ---------------------------------------------------------------------------

    def register_adapter(self, model_id: str) -> None:
        """Adds tenant ``model_id`` with its seeded initial adapter, LR schedule and RNG; ``REFERENCE_MODEL_ID``
        needs no state (its forward runs the base model alone)."""
        if self.store is None:
            raise RuntimeError("register_adapter before init_model")
        if model_id == REFERENCE_MODEL_ID:
            return
        if model_id not in self.tenants:
            raise ValueError(f"unknown tenant {model_id!r}; init_model was given {sorted(self.tenants)}")
        spec = self.tenants[model_id]
        optimizer = self.cfg.policy.optimizer_config
        schedule = LRSchedule(float(spec["lr"]), optimizer.num_warmup_steps, self.total_steps,
                              optimizer.scheduler)
        generator = torch.Generator().manual_seed(int(spec["seed"]))
        weights = init_adapter(self.store.layers, int(spec["rank"]), float(spec["alpha"]), generator)
        self.store.register(model_id, weights, schedule, seed=int(spec["seed"]))

    def delete_adapter(self, model_id: str) -> None:
        self._store().remove(model_id)
        self.staged.pop(model_id, None)
        self.last_metrics.pop(model_id, None)
        if self.active == model_id:
            self.active = None

    def swap_to_adapter(self, model_id: str) -> None:
        if model_id not in self._store().tenants and model_id != REFERENCE_MODEL_ID:
            raise ValueError(f"adapter {model_id!r} is not registered; call register_adapter first")
        self.active = model_id

    def save_tenant_state(self, model_id: str, folder: str) -> None:
        """Writes the tenant's training state into ``folder`` (``trainer.state_io``; a checkpoint)."""
        write_tenant_state(self._store(), model_id, Path(folder))

    def load_tenant_state(self, model_id: str, folder: str) -> int:
        """Replaces the tenant's training state with the one ``folder`` holds; returns its optimizer step."""
        read_tenant_state(self._store(), model_id, Path(folder))
        self.staged.pop(model_id, None)
        return self._store().tenants[model_id].step

    def adapter_store_state(self) -> dict:
        """SkyRL's Megatron worker's schema (``enabled``, ``current_id``: the active adapter, ``registered``,
        ``num_adapters``), plus ``steps``: each registered adapter's optimizer steps."""
        store = self._store()
        registered = sorted(store.tenants)
        return {"enabled": True, "current_id": self.active, "registered": registered, "num_adapters": len(registered),
                "steps": {name: state.step for name, state in store.tenants.items()}}

    # ---- training --------------------------------------------------------------------------------

    def forward(self, data: TrainingInputBatch, loss_fn: Optional[str] = None, loss_fn_config: Optional[dict] = None,
                return_per_token_outputs: bool = True) -> WorkerOutput:
        """SkyRL's inference forward (``loss_fn`` None): per row, ``{"logprobs": [...]}`` of width
        ``metadata["response_length"]``, right-aligned as SkyRL's policy worker returns them, under the active
        adapter (``REFERENCE_MODEL_ID``: the base model alone), of the logits divided by ``cfg.algorithm.temperature``
        (None or 0: 1) whichever the adapter, as SkyRL's policy workers. See :func:`forward_batch`."""
        if loss_fn is not None or loss_fn_config:
            raise ValueError(f"the embedded worker's forward scores log-probs only (got loss_fn={loss_fn!r})")
        tenant = self._active()
        width = int(data.metadata["response_length"])
        batch = forward_batch(data)
        logprobs = self.trainer.response_logprobs(None if tenant == REFERENCE_MODEL_ID else tenant, batch,
                                                  temperature=training_temperature(self.cfg.algorithm)).cpu()
        rows = torch.zeros(len(batch.response_ids), width)
        for i, response in enumerate(batch.response_ids):
            rows[i, width - len(response):] = logprobs[i, : len(response)]
        return WorkerOutput(loss_fn_outputs=[{"logprobs": row.tolist()} for row in rows], metrics={})

    def forward_backward(self, data: TrainingInputBatch, loss_fn: Optional[str] = None,
                         loss_fn_config: Optional[dict] = None, return_per_token_outputs: bool = True) -> WorkerOutput:
        """Stages ``data`` for the active tenant's next :meth:`optim_step` (see module docstring); its metrics:
        the rows staged and ``policy_lr``, the LR that step will use (SkyRL's metric of that name)."""
        if loss_fn not in (None, self.cfg.algorithm.policy_loss_type) or loss_fn_config:
            raise ValueError(f"the embedded worker trains with the configured policy loss "
                             f"{self.cfg.algorithm.policy_loss_type!r} only (got loss_fn={loss_fn!r})")
        tenant = self._trained_tenant()
        batch = training_batch_to_train_batch(data)
        self.staged.setdefault(tenant, []).append(batch)
        staged_rows = sum(len(b.rewards) for b in self.staged[tenant])
        state = self._store().tenants[tenant]
        return WorkerOutput(metrics={"staged_sequences": float(staged_rows),
                                     "policy_lr": state.schedule.lr(state.step)})

    def optim_step(self) -> float:
        """One update of the active tenant over its staged rows; returns the pre-clip gradient norm."""
        tenant = self._trained_tenant()
        batches = self.staged.pop(tenant, [])
        if not batches:
            raise RuntimeError(f"optim_step for {tenant!r} without a forward_backward since its last step")
        merged = TrainBatch(**{
            field.name: (None if any(getattr(b, field.name) is None for b in batches)
                         else [row for b in batches for row in getattr(b, field.name)])
            for field in dataclasses.fields(TrainBatch)
        })
        _, metrics = self.trainer.train_step(tenant, merged)
        self.last_metrics[tenant] = metrics
        return metrics["grad_norm"]

    def step_metrics(self, model_id: str) -> dict[str, float]:
        """The metrics of the tenant's last :meth:`optim_step`."""
        return dict(self.last_metrics.get(model_id, {}))

    def save_memory_snapshot(self, tag: str = "") -> None:
        """No snapshot: ``record_memory`` (CUDA snapshots) is refused by the constructor."""

    def empty_cache(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- weight sync -----------------------------------------------------------------------------

    async def init_weight_sync_state(self, inference_engine_client: Any, inference_engine_cfg: Any) -> None:
        """Keeps the client (its server URLs) for the disk-path syncs."""
        if self.cfg.policy.model.lora.sync_mode != "disk":
            raise ValueError("the embedded worker syncs adapters through disk: set backend.lora_sync_mode=disk")
        self._client = inference_engine_client

    async def broadcast_to_inference_engines(self, inference_engine_client: Any, inference_engine_cfg: Any,
                                             model_id: Optional[str] = None, prefix_cache_salted: bool = False) -> None:
        """Writes ``model_id``'s adapter (the active one) as a PEFT folder and loads it in place under its
        name on every server. No pause and no prefix-cache reset whatever ``prefix_cache_salted`` says (the
        dispatch's hint, patch 0001): the embedded server keys its prefix blocks by adapter version."""
        client = inference_engine_client or self._client
        if client is None:
            raise RuntimeError("broadcast_to_inference_engines before init_weight_sync_state")
        if model_id is None or model_id != self.active:
            raise ValueError(f"sync of {model_id!r} while {self.active!r} is active; WorkerDispatch swaps first")
        state = self._store().tenants[model_id]
        path = Path(self.cfg.policy.model.lora.lora_sync_path) / os.path.basename(model_id)
        await asyncio.to_thread(save_peft_adapter, state.weights, path, self.cfg.policy.model.path)
        await client.load_lora_adapter(model_id, str(path))

    # ---- helpers ---------------------------------------------------------------------------------

    def _store(self) -> AdapterStore:
        if self.store is None:
            raise RuntimeError("the worker's model is not initialised; call init_model first")
        return self.store

    def _active(self) -> str:
        if self.active is None:
            raise RuntimeError("no active adapter: pass model_id to WorkerDispatch so it swaps one in")
        return self.active

    def _trained_tenant(self) -> str:
        """The active adapter, which must be a tenant's: the reference policy is never trained."""
        tenant = self._active()
        if tenant == REFERENCE_MODEL_ID:
            raise ValueError(f"{REFERENCE_MODEL_ID} is the frozen reference policy; it has no training state")
        return tenant
