"""The plugin's configuration: the validated dataclasses of a run (``config.build`` reads the composed Hydra tree,
conf/, into them). Each dataclass checks its own values; what a run's configuration needs of the world around it
(files and folders, SkyRL's registries) is checked where the run is built (:mod:`skyrl_clora.config.checks`).

Errors in user input raise :class:`ConfigError` with a one-line message that names the fix; the entry
point prints it and exits with status 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_clora.sampler.fair_share import ADMISSIONS
from skyrl_clora.tenants import TenantSpec
from skyrl_clora.config.value_types import typed_value


class ConfigError(ValueError):
    """Bad user input; the message is one line that says what to change."""


def checked(value: Any, hint: Any, key: str) -> Any:
    """``config.value_types.typed_value``, its error raised as a :class:`ConfigError`."""
    try:
        return typed_value(value, hint, key)
    except ValueError as error:
        raise ConfigError(str(error)) from None


PACK_POLICIES = ("ready", "lockstep")  # clora.pack_policy: see conf/config.yaml
TRAIN_PRIORITIES = ("arrival", "fewest_updates")  # clora.train_priority: see conf/config.yaml
STEP_STYLES = ("skyrl", "tinker")  # clora.step_style: see conf/config.yaml


@dataclass(frozen=True)
class RecipeConfig:
    """The keys every recipe has (SkyRL's where SkyRL has one: :data:`RECIPE_KEYS`); ``name`` is the recipe folder
    serving ``env_class``; ``options`` is the recipe's own keys under ``recipe.``, an instance of its plugin's
    ``options_type`` (see ``recipes.plugin.Recipe``)."""

    name: str
    env_class: str
    train_data: tuple[str, ...]
    val_data: tuple[str, ...]
    task_variant: str
    prompts_per_step: int
    samples_per_prompt: int
    eval_prompts: int
    max_turns: int
    max_generate_length: int
    max_input_length: int
    options: Any
    max_prompt_length: int
    chat_template_kwargs: dict[str, Any]
    batched: bool

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_turns", "max_generate_length", "max_input_length",
                     "max_prompt_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{RECIPE_KEYS[name]} must be >= 1, got {getattr(self, name)}")
        if self.eval_prompts < 0:
            raise ConfigError(f"recipe.eval_prompts must be >= 0, got {self.eval_prompts}")
        if self.chat_template_kwargs and self.batched:
            raise ConfigError("generator.chat_template_kwargs needs generator.batched=false (SkyRL's rule: batched "
                              "generation leaves the chat template to the engine); set generator.batched=false")


RECIPE_KEYS = {
    "env_class": "environment.env_class", "train_data": "data.train_data", "val_data": "data.val_data",
    "task_variant": "recipe.task_variant", "prompts_per_step": "trainer.train_batch_size",
    "samples_per_prompt": "generator.n_samples_per_prompt", "eval_prompts": "recipe.eval_prompts",
    "max_turns": "generator.max_turns", "max_generate_length": "generator.sampling_params.max_generate_length",
    "max_input_length": "generator.max_input_length", "max_prompt_length": "trainer.max_prompt_length",
    "chat_template_kwargs": "generator.chat_template_kwargs", "batched": "generator.batched",
}
""":class:`RecipeConfig`'s fields and the keys they are read from."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    max_lora_rank: int

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ConfigError(f"sampler.max_lora_rank must be >= 1, got {self.max_lora_rank}")


# SkyRL's Tracking backends that trainer.logger takes (mlflow and swanlab need servers or accounts).
LOGGERS = ("console", "tensorboard", "wandb")


OPTIMIZER_FIELDS = ("lr", "scheduler", "num_warmup_steps", "weight_decay", "max_grad_norm")
""":class:`TrainerConfig`'s fields read from ``trainer.policy.optimizer_config.<field>``."""
PLUGIN_TRAINER_FIELDS = ("pack_size", "pack_policy", "shared_prompts", "sm_carveout", "overlap_sampling",
                         "pause_sampling_rows", "train_priority", "step_style")
""":class:`TrainerConfig`'s fields that are the plugin's own keys, read from ``clora.<field>``; every other field is
SkyRL's ``trainer.<field>``."""


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer's settings, each field named after the key it is read from (``config.build.TRAINER_KEYS``:
    SkyRL's ``trainer.policy.optimizer_config.*`` for :data:`OPTIMIZER_FIELDS`, the plugin's ``clora.*`` for
    :data:`PLUGIN_TRAINER_FIELDS`, SkyRL's ``trainer.*`` otherwise). Its defaults are the composed config's."""

    lr: float
    scheduler: str
    num_warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    micro_train_batch_size_per_gpu: int
    algorithm: dict[str, Any]
    policy_mini_batch_size: int  # prompts per optimizer step
    update_epochs_per_batch: int
    max_tokens_per_microbatch: int
    ckpt_interval: int
    ckpt_path: str | None
    max_ckpts_to_keep: int
    resume_mode: str
    resume_path: str | None
    logger: list[str]
    project_name: str
    run_name: str | None
    eval_interval: int
    eval_before_train: bool
    pack_size: int
    pack_policy: str
    shared_prompts: bool
    sm_carveout: int
    overlap_sampling: bool | None
    pause_sampling_rows: int
    train_priority: str
    step_style: str

    def __post_init__(self) -> None:
        unknown = sorted(set(self.logger) - set(LOGGERS))
        if unknown:
            raise ConfigError(f"trainer.logger={unknown[0]} is unknown; use a list of {', '.join(LOGGERS)} "
                              "(e.g. trainer.logger=[console,tensorboard])")
        if self.ckpt_interval < 0:
            raise ConfigError(f"trainer.ckpt_interval={self.ckpt_interval} must be >= 0 (0: only when a tenant finishes)")
        if self.max_ckpts_to_keep == 0 or self.max_ckpts_to_keep < -1:
            raise ConfigError(f"trainer.max_ckpts_to_keep={self.max_ckpts_to_keep} must be -1 (all) or >= 1")
        if self.resume_mode not in ("latest", "none", "from_path"):
            raise ConfigError(f"trainer.resume_mode={self.resume_mode} is unknown; use latest, none or from_path")
        if (self.resume_mode == "from_path") != (self.resume_path is not None):
            raise ConfigError("trainer.resume_path goes with trainer.resume_mode=from_path (set both, or neither)")
        if self.max_tokens_per_microbatch == 0 or self.max_tokens_per_microbatch < -1:
            raise ConfigError(f"trainer.max_tokens_per_microbatch={self.max_tokens_per_microbatch} must be -1 (micro-batches "
                              "of trainer.micro_train_batch_size_per_gpu rows) or a positive token count")
        if self.step_style not in STEP_STYLES:
            raise ConfigError(f"clora.step_style={self.step_style} is unknown; use skyrl (behaviour log-probs recomputed "
                              "by the trainer) or tinker (the sampler's log-probs reused)")
        if not 0 <= self.sm_carveout < 128:
            raise ConfigError(f"clora.sm_carveout={self.sm_carveout} must be in [0, 128) (SMs left free; 0: none)")
        if self.pack_policy not in PACK_POLICIES:
            raise ConfigError(f"clora.pack_policy={self.pack_policy} is unknown; use {' or '.join(PACK_POLICIES)}")
        if self.train_priority not in TRAIN_PRIORITIES:
            raise ConfigError(f"clora.train_priority={self.train_priority} is unknown; use "
                              f"{' or '.join(TRAIN_PRIORITIES)}")
        if self.pack_size < 0:
            raise ConfigError(f"clora.pack_size must be >= 0 (0: one slot per tenant, up to 8), got {self.pack_size}")
        from skyrl_clora.trainer.lr_schedule import LR_SCHEDULES

        if self.scheduler not in LR_SCHEDULES:
            raise ConfigError(f"trainer.policy.optimizer_config.scheduler={self.scheduler} is not implemented here; "
                              f"use {' or '.join(LR_SCHEDULES)}")
        if self.micro_train_batch_size_per_gpu < 1:
            raise ConfigError("trainer.micro_train_batch_size_per_gpu must be >= 1, got "
                              f"{self.micro_train_batch_size_per_gpu}")
        if self.update_epochs_per_batch < 1:
            raise ConfigError(f"trainer.update_epochs_per_batch must be >= 1, got {self.update_epochs_per_batch}")


KV_CACHE_DTYPE_KEY = "generator.inference_engine.engine_init_kwargs.kv_cache_dtype"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""The embedded engine's KV cache dtypes (SkyRL's pass-through of vLLM's ``kv_cache_dtype``): ``auto``, the model's
dtype; ``fp8`` / ``fp8_e4m3``, ``torch.float8_e4m3fn`` with a scale of 1.0 (vLLM's default without calibrated
scales: half the bytes per KV block and per decode read; values beyond +-448 are out of e4m3's range)."""


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float
    top_p: float
    max_rows: int
    max_prefills_per_step: int
    prefill_block: int
    enable_prefix_caching: bool  # generator.inference_engine.enable_prefix_caching (SkyRL's)
    cuda_graphs: bool
    gpu_memory_utilization: float
    kv_blocks: int
    reuse_decode_kv: bool | None
    prefill_wait_steps: int | None
    stream_priority: str
    adapter_slots: int | None  # device LoRA slots, a cache over the tenants' host adapters; None: one per tenant
    admission: str  # the engine's admission order (fair_share.ADMISSIONS): least served first, or arrival order
    reserve_kv: bool  # admission reserves the KV blocks a request needs to finish (no preemption), or only its prompt's
    # generator.inference_engine.engine_init_kwargs.kv_cache_dtype (KV_CACHE_DTYPES), a free-form key SkyRL passes to
    # vLLM: absent unless given, so its default is vLLM's
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"{KV_CACHE_DTYPE_KEY}={self.kv_cache_dtype} is not supported by the embedded engine; use "
                              f"{', '.join(KV_CACHE_DTYPES)} (fp8 and fp8_e4m3: float8 e4m3, scale 1.0)")
        if self.stream_priority not in ("high", "normal"):
            raise ConfigError(f"sampler.stream_priority={self.stream_priority} is unknown; use high or normal")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError(f"sampler.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("generator.sampling_params.temperature must be >= 0 and generator.sampling_params.top_p in (0, 1]")
        if self.prefill_block < 16 or self.prefill_block % 16:
            raise ConfigError(f"sampler.prefill_block={self.prefill_block} must be a positive multiple of 16")
        if self.max_rows < 0:
            raise ConfigError(f"sampler.max_rows={self.max_rows} must be >= 0 (0: rows for every tenant's whole step batch)")
        if self.max_prefills_per_step < 1:
            raise ConfigError(f"sampler.max_prefills_per_step={self.max_prefills_per_step} must be >= 1")
        if self.prefill_wait_steps is not None and self.prefill_wait_steps < 0:
            raise ConfigError(f"sampler.prefill_wait_steps={self.prefill_wait_steps} must be >= 0 (or null)")
        if self.kv_blocks < 0:
            raise ConfigError(f"sampler.kv_blocks={self.kv_blocks} must be >= 0 (0: from the GPU memory plan)")
        if self.adapter_slots is not None and self.adapter_slots < 1:
            raise ConfigError(f"sampler.adapter_slots={self.adapter_slots} must be >= 1 (or null: one per tenant)")
        if self.admission not in ADMISSIONS:
            raise ConfigError(f"sampler.admission={self.admission} is unknown; use {' or '.join(ADMISSIONS)}")


@dataclass(frozen=True)
class EvalConfig:
    """SkyRL's evaluation: ``sampling_params``, the fields of SkyRL's ``SamplingParams`` that
    ``generator.eval_sampling_params`` builds (SkyRL's default when none is given: greedy, at the training
    ``max_generate_length``), and ``samples_per_prompt`` episodes of each evaluation row
    (``generator.eval_n_samples_per_prompt``)."""

    sampling_params: dict[str, Any]
    samples_per_prompt: int = 1

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1:
            raise ConfigError(f"generator.eval_n_samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        params = self.sampling_params
        if params["max_generate_length"] < 1:
            raise ConfigError("generator.eval_sampling_params.max_generate_length must be >= 1, got "
                              f"{params['max_generate_length']}")
        if params["temperature"] < 0 or not 0 < params["top_p"] <= 1:
            raise ConfigError("generator.eval_sampling_params.temperature must be >= 0 and "
                              "generator.eval_sampling_params.top_p in (0, 1]")

    @property
    def max_generate_length(self) -> int:
        return int(self.sampling_params["max_generate_length"])


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs. ``tenants`` is expanded from ``+tenants=N`` or a list of overrides. ``steps`` (RL
    steps per tenant) depends on the training data: :func:`~skyrl_clora.config.build.plan_steps` derives it as SkyRL
    does from ``trainer.epochs`` and ``trainer.max_training_steps``, and reading it before raises."""

    mode: str
    train_mode: str
    epochs: int
    max_training_steps: int | None
    seed: int
    output_dir: Path
    progress: bool
    device: str
    backend: str
    model_path: str | None
    model_dtype: str
    model_corpus: str
    recipe: RecipeConfig
    lora: LoraConfig
    trainer: TrainerConfig
    sampler: SamplerConfig
    evaluation: EvalConfig
    tenants: tuple[TenantSpec, ...]
    identity: dict[str, Any]
    max_tenants: int = 0
    control: bool = True
    replicas: int = 1
    planned_steps: int | None = None  # set by plan_steps; read through ``steps``

    def __post_init__(self) -> None:
        if self.mode not in ("concurrent", "serial"):
            raise ConfigError(f"clora.mode={self.mode} is unknown; use concurrent or serial")
        if self.train_mode not in ("swap", "packed"):
            raise ConfigError(f"clora.train_mode={self.train_mode} is unknown; use swap or packed")
        if self.mode == "serial" and self.backend != "embedded":
            raise ConfigError("backend=skyrl runs tenants concurrently on one stack; set clora.mode=concurrent "
                              "(serial mode is the embedded backend's baseline)")
        if self.trainer.pack_policy == "lockstep" and self.train_mode != "packed":
            raise ConfigError("clora.pack_policy=lockstep forms packed passes; it needs clora.train_mode=packed")
        if self.train_mode == "packed" and self.backend != "embedded":
            raise ConfigError("clora.train_mode=packed needs backend=embedded; use clora.train_mode=swap")
        if self.trainer.overlap_sampling is False and self.backend != "embedded":
            raise ConfigError("clora.overlap_sampling=false needs backend=embedded (backend=skyrl's servers keep sampling); "
                              "remove the override")
        if self.trainer.train_priority != "arrival" and self.backend != "embedded":
            raise ConfigError(f"clora.train_priority={self.trainer.train_priority} needs backend=embedded (backend=skyrl's "
                              "workers train in arrival order); remove the override")
        if self.epochs < 1:
            raise ConfigError(f"trainer.epochs must be >= 1, got {self.epochs}")
        batch, mini = self.recipe.prompts_per_step, self.trainer.policy_mini_batch_size
        if not 1 <= mini <= batch or batch % mini:
            raise ConfigError(f"trainer.policy_mini_batch_size={mini} must divide trainer.train_batch_size={batch} "
                              "(SkyRL's rule); set it to a divisor of the batch")
        if self.max_training_steps is not None and self.max_training_steps < 1:
            raise ConfigError(f"trainer.max_training_steps must be >= 1 (or null), got {self.max_training_steps}")
        if self.max_tenants < 0:
            raise ConfigError(f"clora.max_tenants={self.max_tenants} must be >= 0 (0: the tenants the run starts with)")
        if self.replicas < 1:
            raise ConfigError(f"clora.replicas={self.replicas} must be >= 1")
        if self.replicas > 1 and (self.backend != "embedded" or self.mode != "concurrent"):
            raise ConfigError("clora.replicas > 1 spreads a concurrent run of backend=embedded over replicas; set "
                              "clora.mode=concurrent and backend=embedded (backend=skyrl places its workers with "
                              "trainer.placement.*)")
        algorithm = self.trainer.algorithm
        if (self.backend == "skyrl" and algorithm.get("use_kl_in_reward")
                and (algorithm.get("kl_ctrl") or {}).get("type", "fixed") != "fixed"):
            raise ConfigError("trainer.algorithm.kl_ctrl.type=adaptive keeps a KL controller per tenant on "
                              "backend=embedded only; use backend=embedded or kl_ctrl.type=fixed")
        if self.backend not in ("embedded", "skyrl"):
            raise ConfigError(f"backend={self.backend} is unknown; use backend=embedded or backend=skyrl")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"clora.device={self.device} is unknown; use auto, cpu or cuda")
        if self.model_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype={self.model_dtype} is unknown; use auto, float32, bfloat16 or float16")
        for spec in self.tenants:
            if spec.rank > self.lora.max_lora_rank:
                raise ConfigError(
                    f"tenant {spec.name} has lora rank {spec.rank} > sampler.max_lora_rank={self.lora.max_lora_rank}; "
                    "lower its rank or raise sampler.max_lora_rank"
                )

    @property
    def steps(self) -> int:
        """RL steps per tenant, as planned from the training rows (:func:`~skyrl_clora.config.build.plan_steps`)."""
        if self.planned_steps is None:
            raise RuntimeError("RunConfig.steps depends on the training rows: build the run with "
                               "config.build.plan_steps(run, train_rows) first")
        return self.planned_steps

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        """A tenant's optimizer (and LR-schedule) steps per RL step: SkyRL's ``policy_steps_per_train_batch``,
        ``train_batch_size // policy_mini_batch_size * update_epochs_per_batch``."""
        trainer = self.trainer
        return self.recipe.prompts_per_step // trainer.policy_mini_batch_size * trainer.update_epochs_per_batch

    @property
    def max_sequence_length(self) -> int:
        """The most tokens one engine row holds: the longest input before a turn (``generator.max_input_length``)
        plus the longest turn, training's or evaluation's (``max_generate_length`` of ``generator.sampling_params``
        and ``generator.eval_sampling_params``)."""
        return self.recipe.max_input_length + max(self.recipe.max_generate_length, self.evaluation.max_generate_length)

    @property
    def tenant_capacity(self) -> int:
        """How many tenants the services are built for: ``clora.max_tenants`` or, when it is less (0), the
        tenants the run starts with."""
        return max(self.max_tenants, len(self.tenants))
