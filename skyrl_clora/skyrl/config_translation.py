"""The plugin's Hydra config (``conf/`` with ``backend=skyrl``) translated into SkyRL 0.4's ``SkyRLTrainConfig``.

SkyRL's CLI parser rejects ``+`` keys (``+tenants=8``), so the translation is done here, in code:

- one base ``SkyRLTrainConfig`` for the shared stack (model, LoRA signature, vLLM servers, Megatron/FSDP
  workers, placement, recipe shape), and
- one ``SkyRLTrainConfig`` per tenant: the base with that tenant's seed, learning rate, group size and
  environment, i.e. what its ``WorkerDispatch(model_id=<tenant>)`` calls and its generator use.

Every config passes SkyRL's own ``validate_cfg``. Before that, the multi-tenant constraints SkyRL does not
check itself are enforced with one-line :class:`~skyrl_clora.config.ConfigError` messages: LoRA on, the
vLLM inference backend, ``merge_lora=false``, ``max_loras >=`` the tenants sampling in one batch, one LoRA
signature (rank, alpha, targets) across tenants (the Megatron ``AdapterStore`` freezes it), an adapter
store on the trainer side (Megatron's; SkyRL 0.4's FSDP workers hold one adapter) and a learning rate
schedule the chosen strategy honours.

Stand-ins: ``backend.inference_backend=embedded`` (the project's engine behind SkyRL's HTTP protocol,
:mod:`skyrl_clora.skyrl.server`) takes the place of vLLM and ``backend.strategy=embedded`` (Ray workers
over the embedded trainer, :mod:`skyrl_clora.skyrl.worker`) the place of Megatron; ``auto`` (the default)
picks vLLM / Megatron when they are importable and the stand-ins otherwise. The SkyRL configs keep the
production values (``vllm``, ``megatron``) so that SkyRL's ``validate_cfg`` checks exactly what a GPU
cluster would run, and a stand-in accepts only what production accepts; :attr:`SkyRLPlan.substitutions`
spells out what is replaced.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from skyrl.train.config import (
    AlgorithmConfig,
    SkyRLTrainConfig,
)
from skyrl.train.utils.utils import validate_cfg

from skyrl_clora.config import (
    ConfigError, LoraConfig, RecipeConfig, SamplerConfig, TrainerConfig, config_section, recipe_config, tenant_specs,
)
from skyrl_clora.recipes.plugin import load_recipe
from skyrl_clora.tenants import TenantSpec

_BACKEND_KEYS = {
    "name", "strategy", "inference_backend", "num_engines", "tensor_parallel_size", "merge_lora", "max_loras",
    "max_cpu_loras", "target_modules", "lora_sync_mode", "lora_sync_path", "enable_prefix_caching",
    "weight_sync_backend", "colocate_all", "policy_num_nodes", "policy_num_gpus_per_node", "gpu_memory_utilization",
}
_SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine"}
_INFERENCE_BACKENDS = ("auto", "vllm", "embedded")
_STRATEGIES = ("auto", "megatron", "fsdp", "embedded")


def resolve_stack(backend: dict[str, Any]) -> tuple[str, str]:
    """``(inference_backend, strategy)`` with ``auto`` resolved: vLLM / Megatron when importable, else
    the embedded stand-ins."""
    inference = backend["inference_backend"]
    if inference == "auto":
        inference = "vllm" if importlib.util.find_spec("vllm") is not None else "embedded"
    strategy = backend["strategy"]
    if strategy == "auto":
        strategy = "megatron" if importlib.util.find_spec("megatron") is not None else "embedded"
    return inference, strategy


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
    """What trains them: ``megatron``, ``fsdp`` or ``embedded`` (``auto`` resolved)."""
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


def check_multi_tenant_constraints(
    backend: dict[str, Any], trainer: TrainerConfig, tenants: list[TenantSpec], tenants_per_batch: int
) -> None:
    """Raises :class:`ConfigError` (one line) for a combination SkyRL cannot run with tenants."""
    if backend["inference_backend"] not in _INFERENCE_BACKENDS:
        raise ConfigError(
            f"backend.inference_backend={backend['inference_backend']}: SkyRL serves LoRA adapters with vllm only; "
            "set backend.inference_backend=vllm (or embedded, its CPU stand-in, or auto)"
        )
    if backend["strategy"] not in _STRATEGIES:
        raise ConfigError(f"backend.strategy={backend['strategy']} is unknown; choose one of {', '.join(_STRATEGIES)}")
    if backend["strategy"] == "fsdp" and len(tenants) > 1:
        raise ConfigError(
            f"backend.strategy=fsdp with {len(tenants)} tenants: SkyRL 0.4's FSDP workers hold one LoRA adapter "
            "(no AdapterStore); use backend.strategy=megatron (or embedded, its CPU stand-in)"
        )
    if backend["merge_lora"]:
        raise ConfigError(
            "backend.merge_lora=true merges one adapter into the shared base weights, so tenants cannot coexist; "
            "set backend.merge_lora=false"
        )
    if backend["max_loras"] is not None and backend["max_loras"] < tenants_per_batch:
        raise ConfigError(
            f"backend.max_loras={backend['max_loras']} < {tenants_per_batch} tenants sampling in one batch; "
            f"raise backend.max_loras to >= {tenants_per_batch} (or null)"
        )
    if backend["max_cpu_loras"] is not None and backend["max_cpu_loras"] < len(tenants):
        raise ConfigError(
            f"backend.max_cpu_loras={backend['max_cpu_loras']} < {len(tenants)} tenants: adapters would be evicted; "
            f"raise it to >= {len(tenants)} (or null)"
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
    if backend["strategy"] in ("megatron", "embedded", "auto") and trainer.lr_schedule != "constant":
        raise ConfigError(
            f"trainer.lr_schedule={trainer.lr_schedule}: SkyRL 0.4's Megatron scheduler is constant-only "
            "(lr_decay_style is fixed; backend.strategy=embedded stands in for megatron and takes what it takes); "
            "use trainer.lr_schedule=constant"
        )


def _base_config(
    cfg: DictConfig, backend: dict[str, Any], recipe: RecipeConfig, trainer: TrainerConfig, sampler: SamplerConfig,
    tenants: list[TenantSpec], tenants_per_batch: int, model_path: str,
) -> SkyRLTrainConfig:
    st = SkyRLTrainConfig()
    first = tenants[0]
    gpus = backend["policy_num_nodes"] * backend["policy_num_gpus_per_node"]
    per_gpu = max(1, recipe.prompts_per_step * recipe.samples_per_prompt // gpus)

    tr = st.trainer
    tr.strategy = "fsdp" if backend["strategy"] == "fsdp" else "megatron"  # embedded stands in for megatron
    tr.seed = int(cfg.clora.seed)
    tr.max_training_steps = int(cfg.clora.steps)
    tr.train_batch_size = recipe.prompts_per_step
    tr.policy_mini_batch_size = recipe.prompts_per_step
    tr.micro_train_batch_size_per_gpu = math.gcd(trainer.micro_batch_size, per_gpu)
    tr.micro_forward_batch_size_per_gpu = math.gcd(trainer.micro_batch_size, per_gpu)
    tr.max_tokens_per_microbatch = trainer.max_tokens_per_microbatch
    tr.max_prompt_length = recipe.max_input_length
    tr.eval_batch_size = max(1, recipe.eval_prompts)
    tr.eval_before_train = recipe.eval_prompts > 0
    tr.logger = "console"
    tr.run_name = os.path.basename(os.path.normpath(str(cfg.clora.output_dir)))
    tr.placement.colocate_all = bool(backend["colocate_all"])
    tr.placement.policy_num_nodes = backend["policy_num_nodes"]
    tr.placement.policy_num_gpus_per_node = backend["policy_num_gpus_per_node"]
    tr.algorithm = AlgorithmConfig(**trainer.algorithm)

    policy = tr.policy
    policy.model.path = model_path
    lora = policy.model.lora
    lora.rank = first.rank
    lora.alpha = int(first.alpha)
    lora.target_modules = backend["target_modules"]
    lora.sync_mode = backend["lora_sync_mode"]
    sync_path = backend["lora_sync_path"] or os.path.join(str(cfg.clora.output_dir), "lora_sync")
    lora.lora_sync_path = os.path.abspath(os.path.expanduser(sync_path))
    lora.max_loras = backend["max_loras"] if backend["max_loras"] is not None else tenants_per_batch
    lora.max_cpu_loras = backend["max_cpu_loras"] if backend["max_cpu_loras"] is not None else max(
        len(tenants), lora.max_loras
    )
    policy.megatron_config.lora_config.merge_lora = bool(backend["merge_lora"])
    opt = policy.optimizer_config
    opt.lr = first.lr
    opt.weight_decay = trainer.weight_decay
    opt.max_grad_norm = trainer.max_grad_norm
    opt.num_warmup_steps = trainer.warmup_steps
    opt.scheduler = _SCHEDULERS[trainer.lr_schedule]

    gen = st.generator
    gen.n_samples_per_prompt = recipe.samples_per_prompt
    gen.max_turns = recipe.max_turns
    gen.max_input_length = recipe.max_input_length
    gen.batched = False
    gen.sampling_params.max_generate_length = recipe.max_generate_length
    gen.sampling_params.temperature = sampler.temperature
    gen.sampling_params.top_p = sampler.top_p
    gen.sampling_params.logprobs = 1
    ie = gen.inference_engine
    ie.backend = "vllm"  # embedded stands in for vllm
    ie.num_engines = backend["num_engines"]
    ie.tensor_parallel_size = backend["tensor_parallel_size"]
    ie.enable_prefix_caching = bool(backend["enable_prefix_caching"])
    ie.weight_sync_backend = backend["weight_sync_backend"]
    ie.gpu_memory_utilization = float(backend["gpu_memory_utilization"])

    st.environment.env_class = recipe.env_class
    st.data.train_data = [recipe.train_data] if recipe.train_data else []
    st.data.val_data = [recipe.val_data] if recipe.val_data else []
    st.trainer.algorithm.temperature = sampler.temperature
    return st


def _validated(st: SkyRLTrainConfig, who: str) -> SkyRLTrainConfig:
    """Runs SkyRL's ``validate_cfg``; its assertion or value error becomes a one-line ConfigError."""
    try:
        validate_cfg(st)
    except (AssertionError, ValueError, NotImplementedError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(f"SkyRL rejects the translated config ({who}): {message}") from None
    return st


def translate(cfg: DictConfig, model_path: str | None = None) -> SkyRLPlan:
    """Translates the composed Hydra config (``backend=skyrl``) into SkyRL configs; raises ConfigError.

    ``model_path`` is the base model folder when ``model.path`` is null (e.g. the tiny base, resolved by
    the caller); the vLLM servers and the workers all load it."""
    backend = _backend(cfg)
    lora = config_section(LoraConfig, cfg.lora, "lora")
    if lora_rank_off(cfg):
        raise ConfigError("lora.rank=0 turns LoRA off; backend=skyrl runs each tenant as a LoRA adapter: set lora.rank >= 1")
    trainer = config_section(TrainerConfig, cfg.trainer, "trainer")
    recipe = recipe_config(cfg.recipe)
    refusal = load_recipe(recipe.name).refuses(recipe, "skyrl")
    if refusal is not None:
        raise ConfigError(refusal)
    sampler = config_section(SamplerConfig, cfg.sampler, "sampler")
    tenants = tenant_specs(cfg, lora, trainer, recipe)
    path = cfg.model.path if cfg.model.path is not None else model_path
    if path is None:
        raise ConfigError("backend=skyrl needs a base model folder: set model.path=/path/to/hf-checkpoint")
    path = os.path.expanduser(str(path))
    tenants_per_batch = len(tenants) if str(cfg.clora.mode) == "concurrent" else 1
    check_multi_tenant_constraints(backend, trainer, tenants, tenants_per_batch)

    base = _validated(_base_config(cfg, backend, recipe, trainer, sampler, tenants, tenants_per_batch, path), "shared")
    per_tenant = {}
    for spec in tenants:
        st = copy.deepcopy(base)
        st.trainer.seed = spec.seed
        st.trainer.policy.optimizer_config.lr = spec.lr
        st.generator.n_samples_per_prompt = spec.samples_per_prompt
        if spec.env_class is not None:
            st.environment.env_class = spec.env_class
        per_tenant[spec.name] = _validated(st, f"tenant {spec.name}")
    inference, strategy = resolve_stack(backend)
    substitutions = []
    if inference == "embedded":
        substitutions.append("generator.inference_engine.backend=vllm -> the embedded engine behind SkyRL's HTTP "
                             "protocol (skyrl_clora.skyrl.server), one server")
    if strategy == "embedded":
        substitutions.append("trainer.strategy=megatron -> Ray workers over the embedded trainer "
                             "(skyrl_clora.skyrl.worker.EmbeddedPolicyWorker), one worker")
    return SkyRLPlan(base=base, tenant_configs=per_tenant, tenants=tuple(tenants), tenants_per_batch=tenants_per_batch,
                     inference_backend=inference, strategy=strategy, substitutions=tuple(substitutions))


def lora_rank_off(cfg: DictConfig) -> bool:
    """True when the config turns LoRA off (``lora.rank`` 0 or a tenant with rank 0)."""
    if int(cfg.lora.rank) < 1:
        return True
    value = cfg.get("tenants", 1)
    if OmegaConf.is_list(value):
        return any(int(entry.get("rank", 1)) < 1 for entry in value if OmegaConf.is_dict(entry))
    return False
