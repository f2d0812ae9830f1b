"""The plugin's Hydra config (``backend=skyrl``) translated into SkyRL 0.4's ``SkyRLTrainConfig``.

SkyRL's CLI parser rejects ``+`` keys (``+tenants=8``), so the composed config is translated here, in code. Its
``data``, ``trainer``, ``generator`` and ``environment`` trees are SkyRL's own key tree (``config.keys``), so the
translation is SkyRL's builder over them, as given, and then:

- ``trainer.strategy`` (SkyRL's ``fsdp``, its default, or its alias ``fsdp2``; or ``megatron``) names the policy
  workers, ``backend.strategy`` (``fsdp2``, ``megatron``) may name them too (:func:`production_strategy`);
- the keys of :data:`~skyrl_clora.config.keys.SKYRL_SET` set by the plugin (the tiny base's path, the LoRA
  adapter counts and sync folder when null, ...); a value given for one of them that the plugin cannot keep is
  refused; a hub id as the model path is resolved in huggingface_hub's cache;
- vLLM's ``logprobs_mode=processed_logprobs`` when the sampling temperature is not 1 (or 0), so that the rollout
  log-probs are of the tempered distribution the trainer scores (``trainer.algorithm.temperature``, which SkyRL's
  ``SkyRLTrainConfig`` sets to the sampling temperature unless given);
- one ``SkyRLTrainConfig`` per tenant: the base with that tenant's seed, learning rate, group size and
  environment, i.e. what its ``WorkerDispatch(model_id=<tenant>)`` calls and its generator use.

Every config passes SkyRL's own ``validate_cfg``. Before that, the multi-tenant constraints SkyRL does not
check itself are enforced with one-line :class:`~skyrl_clora.config.schema.ConfigError` messages: LoRA on, the
vLLM inference backend, ``merge_lora=false``, ``max_loras >=`` the tenants sampling in one batch, one LoRA
signature (rank, alpha, targets) across tenants (the Megatron ``AdapterStore`` freezes it) and a learning rate
schedule the chosen workers honour.

Stand-ins: ``backend.inference_backend=embedded`` (the project's engine behind SkyRL's HTTP protocol,
:mod:`skyrl_clora.backends.skyrl.server`) takes the place of vLLM and ``backend.strategy=embedded`` (Ray workers
over the embedded trainer, :mod:`skyrl_clora.skyrl.worker`) the place of the FSDP2 or Megatron workers; ``auto``
(the default) picks vLLM when importable and the named workers when this machine runs them (:func:`resolve_stack`),
the stand-ins otherwise. The SkyRL configs keep the production values (``vllm``, ``fsdp`` or ``megatron``) so that
SkyRL's ``validate_cfg`` checks exactly what a GPU cluster would run, and a stand-in accepts only what production
accepts; :attr:`SkyRLPlan.substitutions` spells out what is replaced.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from skyrl.train.config import GeneratorConfig, SkyRLTrainConfig
from skyrl.train.config.config import build_nested_dataclass
from skyrl.train.utils.utils import validate_cfg

from skyrl_clora.config.schema import ConfigError, TrainerConfig
from skyrl_clora.config.build import lora_config, recipe_config, resolve_model_path, tenant_specs, trainer_config
from skyrl_clora.config.keys import SKYRL_GROUPS, check_skyrl_keys
from skyrl_clora.recipes.plugin import load_recipe
from skyrl_clora.tenants import TenantSpec

_BACKEND_KEYS = {"name", "strategy", "inference_backend"}
VLLM_LOGPROBS_MODE = "processed_logprobs"
"""vLLM's ``logprobs_mode`` at a sampling temperature other than 1: the log-probs of the tempered logits the token
was drawn from (after vLLM's top-k/top-p too: with ``top_p < 1`` they are renormalised over the nucleus, which the
trainer's are not)."""
_INFERENCE_BACKENDS = ("auto", "vllm", "embedded")
_STRATEGIES = ("auto", "fsdp2", "megatron", "embedded")
SKYRL_STRATEGIES = {"fsdp": "fsdp2", "fsdp2": "fsdp2", "megatron": "megatron"}
"""SkyRL 0.4's ``trainer.strategy`` values and the policy workers each names (``backend.strategy``): SkyRL reads
``fsdp2`` as ``fsdp``, its FSDP2 workers."""
SKYRL_STRATEGY_NAMES = {"fsdp2": "fsdp", "megatron": "megatron"}
"""The ``trainer.strategy`` SkyRL's config gets for each production ``backend.strategy``."""


def production_strategy(backend: dict[str, Any], trainer_strategy: str, given: Collection[str]) -> str:
    """The SkyRL policy workers the run means (``fsdp2`` or ``megatron``): ``backend.strategy`` when it names them,
    else SkyRL's ``trainer.strategy`` (its default ``fsdp``: fsdp2). A value SkyRL does not know, or a given
    ``trainer.strategy`` that names other workers than a given ``backend.strategy``, is a :class:`ConfigError`."""
    if trainer_strategy not in SKYRL_STRATEGIES:
        raise ConfigError(f"trainer.strategy={trainer_strategy} is not one of SkyRL 0.4's: use fsdp (fsdp2) or megatron")
    named = SKYRL_STRATEGIES[trainer_strategy]
    if backend["strategy"] in SKYRL_STRATEGY_NAMES:
        if "trainer.strategy" in given and named != backend["strategy"]:
            raise ConfigError(f"trainer.strategy={trainer_strategy} names other workers than backend.strategy="
                              f"{backend['strategy']}; drop one of them (backend.strategy=auto follows trainer.strategy)")
        return backend["strategy"]
    return named


MEGATRON_WORKER_PACKAGES = ("megatron.core", "megatron.bridge", "transformer_engine")
"""What SkyRL 0.4's Megatron policy worker (``skyrl.backends.skyrl_train.workers.megatron``) imports beside torch:
megatron-core, Megatron-Bridge (its model providers) and TransformerEngine."""


def importable(module: str) -> bool:
    """Whether ``module`` (dotted names too) can be imported here, without importing it past its parent packages;
    False when a parent package is absent."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def why_workers_cannot_run(production: str, inference: str) -> str | None:
    """Why SkyRL's ``production`` policy workers (``fsdp2`` or ``megatron``) cannot run on this machine beside the
    ``inference`` backend, in a few words, or None when they can: FSDP2 needs a CUDA GPU; Megatron needs the
    packages of :data:`MEGATRON_WORKER_PACKAGES`, a CUDA GPU and vLLM (its weight sync imports vLLM and calls an
    endpoint only vLLM serves)."""
    if production == "megatron":
        missing = [module for module in MEGATRON_WORKER_PACKAGES if not importable(module)]
        if missing:
            return f"SkyRL's Megatron worker imports {', '.join(missing)}, not importable here"
        if inference != "vllm":
            return "SkyRL's Megatron worker syncs weights through vLLM, which is not installed"
    if not torch.cuda.is_available():
        return f"SkyRL's {'Megatron' if production == 'megatron' else 'FSDP2'} worker needs a CUDA GPU; none is visible"
    return None


def resolve_stack(backend: dict[str, Any], production: str) -> tuple[str, str, str | None]:
    """``(inference_backend, strategy, why)`` with ``auto`` resolved: vLLM when importable, the ``production``
    workers when this machine runs them (:func:`why_workers_cannot_run`), else the embedded stand-ins; ``why``
    says why ``auto`` did not pick the production workers (None when it did, or ``backend.strategy`` was given)."""
    inference = backend["inference_backend"]
    if inference == "auto":
        inference = "vllm" if importable("vllm") else "embedded"
    strategy, why = backend["strategy"], None
    if strategy == "auto":
        why = why_workers_cannot_run(production, inference)
        strategy = production if why is None else "embedded"
    return inference, strategy, why


@dataclass(frozen=True)
class SkyRLPlan:
    """The translated run: the shared stack's config, each tenant's config, and the tenants in order."""

    base: SkyRLTrainConfig
    tenant_configs: dict[str, SkyRLTrainConfig]
    tenants: tuple[TenantSpec, ...]
    tenants_per_batch: int
    inference_backend: str
    """What serves the tenants: ``vllm`` or ``embedded`` (``auto`` resolved)."""
    strategy: str
    """What trains them: ``fsdp2``, ``megatron`` or ``embedded`` (``auto`` resolved)."""
    substitutions: tuple[str, ...]
    """One line per production component replaced by a stand-in (empty on a GPU cluster)."""


def _backend(cfg: DictConfig) -> dict[str, Any]:
    backend = OmegaConf.to_container(cfg.backend, resolve=True)
    if backend.get("name") != "skyrl":
        raise ConfigError(f"backend={backend.get('name')} cannot be translated to SkyRL; use backend=skyrl")
    unknown = sorted(set(backend) - _BACKEND_KEYS)
    missing = sorted(_BACKEND_KEYS - set(backend))
    if unknown or missing:
        key = (unknown or missing)[0]
        raise ConfigError(f"backend.{key} is {'unknown' if unknown else 'missing'}; see conf/backend/skyrl.yaml")
    return backend


def skyrl_tree(cfg: DictConfig) -> dict[str, Any]:
    """SkyRL's key tree of the composed config, as given."""
    return {group: OmegaConf.to_container(cfg[group], resolve=True) for group in SKYRL_GROUPS}


def check_multi_tenant_constraints(
    backend: dict[str, Any], tree: dict[str, Any], trainer: TrainerConfig, tenants: list[TenantSpec],
    tenants_per_batch: int, production: str,
) -> None:
    """Raises :class:`ConfigError` (one line) for a combination SkyRL cannot run with tenants (``tree``: SkyRL's key
    tree as given; ``production``: the policy workers meant, :func:`production_strategy`)."""
    if backend["inference_backend"] not in _INFERENCE_BACKENDS:
        raise ConfigError(
            f"backend.inference_backend={backend['inference_backend']}: SkyRL serves LoRA adapters with vllm only; "
            "set backend.inference_backend=vllm (or embedded, its CPU stand-in, or auto)"
        )
    if backend["strategy"] not in _STRATEGIES:
        raise ConfigError(f"backend.strategy={backend['strategy']} is unknown; choose one of {', '.join(_STRATEGIES)}")
    if tree["trainer"]["policy"]["megatron_config"]["lora_config"]["merge_lora"]:
        raise ConfigError(
            "trainer.policy.megatron_config.lora_config.merge_lora=true merges one adapter into the shared base "
            "weights, so tenants cannot coexist; set it to false"
        )
    lora = tree["trainer"]["policy"]["model"]["lora"]
    if lora["max_loras"] is not None and lora["max_loras"] < tenants_per_batch:
        raise ConfigError(
            f"trainer.policy.model.lora.max_loras={lora['max_loras']} < {tenants_per_batch} tenants sampling in one "
            f"batch; raise it to >= {tenants_per_batch} (or null)"
        )
    if lora["max_cpu_loras"] is not None and lora["max_cpu_loras"] < len(tenants):
        raise ConfigError(
            f"trainer.policy.model.lora.max_cpu_loras={lora['max_cpu_loras']} < {len(tenants)} tenants: adapters "
            f"would be evicted; raise it to >= {len(tenants)} (or null)"
        )
    signatures = {(spec.rank, spec.alpha) for spec in tenants}
    if len(signatures) > 1:
        listed = ", ".join(f"{spec.name}: rank {spec.rank} alpha {spec.alpha:g}" for spec in tenants)
        raise ConfigError(
            f"tenants differ in LoRA signature ({listed}); SkyRL's AdapterStore needs one rank/alpha/targets for all "
            "tenants on backend=skyrl"
        )
    alpha = tenants[0].alpha
    if alpha != int(alpha):
        raise ConfigError(f"lora alpha {alpha:g} is not an integer; SkyRL's LoRA config takes an integer alpha")
    if production == "megatron" and (
            trainer.scheduler == "cosine" or (trainer.scheduler == "constant" and trainer.num_warmup_steps > 0)):
        raise ConfigError(
            f"trainer.policy.optimizer_config.scheduler={tree['trainer']['policy']['optimizer_config']['scheduler']}: "
            "SkyRL 0.4's Megatron scheduler is constant with linear warm-up whatever the name (lr_decay_style is fixed; "
            "backend.strategy=embedded stands in for megatron and takes what it takes); use constant_with_warmup or "
            "trainer.strategy=fsdp"
        )


def _set_by_plugin(st: SkyRLTrainConfig, cfg: DictConfig, tenants: list[TenantSpec], tenants_per_batch: int,
                   model_path: str, given: Collection[str]) -> None:
    """Sets the keys of ``config.keys.SKYRL_SET`` on ``st`` (``trainer.strategy`` is set before SkyRL's builder
    runs), refusing a given value the plugin cannot keep."""
    tr, gen = st.trainer, st.generator
    if gen.inference_engine.backend != "vllm":
        raise ConfigError(f"generator.inference_engine.backend={gen.inference_engine.backend}: tenants' adapters are "
                          "served by vLLM (or its embedded stand-in); set it to vllm")
    if gen.sampling_params.logprobs is None:
        raise ConfigError("generator.sampling_params.logprobs=null: the step needs the sampled tokens' log-probs; "
                          "set it to 1")
    _set_vllm_logprobs_mode(gen)
    policy = tr.policy
    policy.model.path = resolve_model_path(policy.model.path) if policy.model.path else model_path
    policy.model.lora.rank, policy.model.lora.alpha = tenants[0].rank, int(tenants[0].alpha)
    lora = policy.model.lora
    lora.max_loras = lora.max_loras if lora.max_loras is not None else tenants_per_batch
    lora.max_cpu_loras = lora.max_cpu_loras if lora.max_cpu_loras is not None else max(len(tenants), lora.max_loras)
    sync_path = lora.lora_sync_path or os.path.join(str(cfg.clora.output_dir), "lora_sync")
    lora.lora_sync_path = os.path.abspath(os.path.expanduser(sync_path))
    if tr.ckpt_path is None:
        tr.ckpt_path = os.path.join(str(cfg.clora.output_dir), "checkpoints")
    tr.run_name = tr.run_name or os.path.basename(os.path.normpath(str(cfg.clora.output_dir)))
    gpus = tr.placement.policy_num_nodes * tr.placement.policy_num_gpus_per_node
    per_gpu = max(1, tr.policy_mini_batch_size * gen.n_samples_per_prompt // gpus)
    if "trainer.micro_train_batch_size_per_gpu" not in given:  # SkyRL's batch-size check: a divisor of the rows per GPU
        tr.micro_train_batch_size_per_gpu = math.gcd(tr.micro_train_batch_size_per_gpu, per_gpu)
    if "trainer.micro_forward_batch_size_per_gpu" not in given:  # a forward alone holds less than forward + backward
        tr.micro_forward_batch_size_per_gpu = tr.micro_train_batch_size_per_gpu


def _set_vllm_logprobs_mode(gen: GeneratorConfig) -> None:
    """Sets vLLM's ``logprobs_mode=processed_logprobs`` (through SkyRL's pass-through ``engine_init_kwargs``, or both
    PD roles' ``prefill_init_kwargs``/``decode_init_kwargs`` when those are given) when the sampling temperature is
    neither 1 nor 0 (greedy): vLLM reports the raw model's log-probs by default, while the trainer's are of
    ``logits / T`` (the Tinker-style step and the off-policy correction compare the two). A given other mode is
    refused."""
    temperature = gen.sampling_params.temperature
    if temperature in (0, 1):
        return
    ie = gen.inference_engine
    roles = ("prefill_init_kwargs", "decode_init_kwargs") if ie.prefill_init_kwargs or ie.decode_init_kwargs else (
        "engine_init_kwargs",)
    for role in roles:
        kwargs = getattr(ie, role)
        given = kwargs.get("logprobs_mode", VLLM_LOGPROBS_MODE)
        if given != VLLM_LOGPROBS_MODE:
            raise ConfigError(
                f"generator.inference_engine.{role}.logprobs_mode={given} with generator.sampling_params.temperature="
                f"{temperature}: vLLM would report log-probs of another distribution than the trainer's logits / T; "
                f"drop it (the plugin sets {VLLM_LOGPROBS_MODE})")
        kwargs["logprobs_mode"] = VLLM_LOGPROBS_MODE


def _validated(st: SkyRLTrainConfig, who: str) -> SkyRLTrainConfig:
    """Runs SkyRL's ``validate_cfg``; its assertion or value error becomes a one-line ConfigError."""
    try:
        validate_cfg(st)
    except (AssertionError, ValueError, NotImplementedError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(f"SkyRL rejects the translated config ({who}): {message}") from None
    return st


def _built(tree: dict[str, Any]) -> SkyRLTrainConfig:
    """SkyRL's own builder over ``tree``; what it rejects becomes a one-line ConfigError."""
    try:
        return build_nested_dataclass(SkyRLTrainConfig, tree)
    except (AssertionError, ValueError, TypeError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(f"SkyRL rejects the config: {message}") from None


def translate(cfg: DictConfig, model_path: str | None = None, given: Collection[str] = ()) -> SkyRLPlan:
    """Translates the composed Hydra config (``backend=skyrl``) into SkyRL configs; raises ConfigError.

    ``model_path`` is the base model folder when ``trainer.policy.model.path`` is null (e.g. the tiny base,
    resolved by the caller); the vLLM servers and the workers all load it. ``given`` is the keys the command
    line set (a given ``trainer.strategy`` must agree with ``backend.strategy``; given micro-batch sizes are kept; a
    given key only SkyRL's trainer loop reads is refused or logged as ignored: ``config.keys.check_skyrl_keys``)."""
    backend = _backend(cfg)
    refusals = check_skyrl_keys(cfg, given)
    if refusals:
        raise ConfigError("\n".join(refusals))
    if lora_rank_off(cfg):
        raise ConfigError("trainer.policy.model.lora.rank=0 turns LoRA off; backend=skyrl runs each tenant as a LoRA "
                          "adapter: set it >= 1")
    trainer = trainer_config(cfg)
    recipe = recipe_config(cfg)
    refusal = load_recipe(recipe.name).refuses(recipe, "skyrl")
    if refusal is not None:
        raise ConfigError(refusal)
    tenants = tenant_specs(cfg, lora_config(cfg), trainer, recipe)
    if cfg.trainer.policy.model.path is None and model_path is None:
        raise ConfigError("backend=skyrl needs a base model folder: set trainer.policy.model.path=/path/to/hf-checkpoint")
    tenants_per_batch = len(tenants) if str(cfg.clora.mode) == "concurrent" else 1
    tree = skyrl_tree(cfg)
    production = production_strategy(backend, str(tree["trainer"]["strategy"]), given)
    tree["trainer"]["strategy"] = SKYRL_STRATEGY_NAMES[production]  # the embedded stand-in keeps what it stands in for
    check_multi_tenant_constraints(backend, tree, trainer, tenants, tenants_per_batch, production)
    base = _built(tree)
    _set_by_plugin(base, cfg, tenants, tenants_per_batch, os.path.expanduser(str(model_path or "")), given)
    base = _validated(base, "shared")
    per_tenant = {}
    for spec in tenants:
        st = copy.deepcopy(base)
        st.trainer.seed = spec.seed
        st.trainer.policy.optimizer_config.lr = spec.lr
        st.generator.n_samples_per_prompt = spec.samples_per_prompt
        if spec.env_class is not None:
            st.environment.env_class = spec.env_class
        per_tenant[spec.name] = _validated(st, f"tenant {spec.name}")
    inference, strategy, why = resolve_stack(backend, production)
    substitutions = []
    if inference == "embedded":
        substitutions.append("generator.inference_engine.backend=vllm -> the embedded engine behind SkyRL's HTTP "
                             "protocol (skyrl_clora.backends.skyrl.server), one server")
    if strategy == "embedded":
        substitutions.append(f"trainer.strategy={SKYRL_STRATEGY_NAMES[production]} -> Ray workers over the embedded "
                             "trainer (skyrl_clora.skyrl.worker.EmbeddedPolicyWorker), one worker"
                             + (f" (backend.strategy=auto: {why})" if why else ""))
    if inference == "embedded" and base.trainer.placement.colocate_all:
        for st in [base, *per_tenant.values()]:  # what the workers' WorkerDispatch reads: no sleep/offload cycle
            st.trainer.placement.colocate_all = False
        substitutions.append("trainer.placement.colocate_all=true -> the embedded server shares the devices with the "
                             "workers, awake: no sleep/wake of the servers or offload of the workers around a sync")
    return SkyRLPlan(base=base, tenant_configs=per_tenant, tenants=tuple(tenants), tenants_per_batch=tenants_per_batch,
                     inference_backend=inference, strategy=strategy, substitutions=tuple(substitutions))


def lora_rank_off(cfg: DictConfig) -> bool:
    """True when the config turns LoRA off (``trainer.policy.model.lora.rank`` 0 or a tenant with rank 0)."""
    if int(cfg.trainer.policy.model.lora.rank) < 1:
        return True
    value = cfg.get("tenants", 1)
    if OmegaConf.is_list(value):
        return any(int(entry.get("rank", 1)) < 1 for entry in value if OmegaConf.is_dict(entry))
    return False
