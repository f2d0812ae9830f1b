"""The plugin's configuration: the composed Hydra tree (conf/) turned into validated dataclasses.

Errors in user input raise :class:`ConfigError` with a one-line message that names the fix; the entry
point prints it and exits with status 2.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from collections.abc import Callable
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf

from skyrl_clora.tenants import TenantSpec, expand_tenants
from skyrl_clora.value_types import typed_value


class ConfigError(ValueError):
    """Bad user input; the message is one line that says what to change."""


def checked(value: Any, hint: Any, key: str) -> Any:
    """``value_types.typed_value``, its error raised as a :class:`ConfigError`."""
    try:
        return typed_value(value, hint, key)
    except ValueError as error:
        raise ConfigError(str(error)) from None


PACK_POLICIES = ("ready", "lockstep")  # trainer.pack_policy: see conf/config.yaml


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

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_turns", "max_generate_length", "max_input_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{RECIPE_KEYS[name]} must be >= 1, got {getattr(self, name)}")
        if self.eval_prompts < 0:
            raise ConfigError(f"recipe.eval_prompts must be >= 0, got {self.eval_prompts}")
        for name in ("train_data", "val_data"):
            for path in getattr(self, name):
                if not Path(path).exists():
                    raise ConfigError(f"{RECIPE_KEYS[name]}: {path} does not exist; point it at an existing file")


RECIPE_KEYS = {
    "env_class": "environment.env_class", "train_data": "data.train_data", "val_data": "data.val_data",
    "task_variant": "recipe.task_variant", "prompts_per_step": "trainer.train_batch_size",
    "samples_per_prompt": "generator.n_samples_per_prompt", "eval_prompts": "recipe.eval_prompts",
    "max_turns": "generator.max_turns", "max_generate_length": "generator.sampling_params.max_generate_length",
    "max_input_length": "generator.max_input_length",
}
""":class:`RecipeConfig`'s fields and the keys they are read from."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    max_rank: int

    def __post_init__(self) -> None:
        if self.max_rank < 1:
            raise ConfigError(f"sampler.max_lora_rank must be >= 1, got {self.max_rank}")


def algorithm_config(algorithm: dict[str, Any]) -> Any:
    """SkyRL's ``AlgorithmConfig`` built from ``trainer.algorithm`` (nested configs included)."""
    from skyrl.train.config import AlgorithmConfig
    from skyrl.train.config.config import build_nested_dataclass

    return build_nested_dataclass(AlgorithmConfig, algorithm)


def check_algorithm(algorithm: dict[str, Any]) -> None:
    """``trainer.algorithm`` as SkyRL's ``AlgorithmConfig`` takes it, with an advantage estimator and a policy loss
    that SkyRL's registries hold (a custom one registered before the run counts), and no KL term (the tenants'
    step computes none); else a :class:`ConfigError`."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry
    from skyrl.train.config import AlgorithmConfig

    hints = get_type_hints(AlgorithmConfig)
    for key, value in algorithm.items():
        hint = hints.get(key)
        if hint in (int, float, bool, str) or hint in (int | None, float | None, bool | None, str | None):
            checked(value, hint, f"trainer.algorithm.{key}")
    for key in ("use_kl_loss", "use_kl_in_reward"):
        if algorithm.get(key):
            raise ConfigError(f"trainer.algorithm.{key}=true: the tenants' step has no KL term yet; set it to false")
    try:
        algorithm_config(algorithm)
    except (TypeError, ValueError, AssertionError) as error:
        raise ConfigError(f"trainer.algorithm: {str(error).splitlines()[0]}") from None
    for key, registry in (("advantage_estimator", AdvantageEstimatorRegistry), ("policy_loss_type", PolicyLossRegistry)):
        available = registry.list_available()
        if key in algorithm and algorithm[key] not in available:
            raise ConfigError(f"trainer.algorithm.{key}={algorithm[key]} is not in SkyRL's registry; use one of "
                              f"{', '.join(sorted(available))} (or register yours with SkyRL before the run)")


SCHEDULERS = {"constant_with_warmup": "constant", "constant": "constant", "cosine": "cosine"}
"""SkyRL's ``trainer.policy.optimizer_config.scheduler`` values the trainers implement, and their schedule."""

TRAINER_KEYS = {
    "lr": "trainer.policy.optimizer_config.lr", "lr_schedule": "trainer.policy.optimizer_config.scheduler",
    "warmup_steps": "trainer.policy.optimizer_config.num_warmup_steps",
    "weight_decay": "trainer.policy.optimizer_config.weight_decay",
    "max_grad_norm": "trainer.policy.optimizer_config.max_grad_norm",
    "micro_batch_size": "trainer.micro_train_batch_size_per_gpu", "algorithm": "trainer.algorithm",
    **{name: f"trainer.{name}" for name in (
        "max_tokens_per_microbatch", "ckpt_interval", "ckpt_path", "max_ckpts_to_keep", "resume_mode", "resume_path",
        "logger", "project_name", "run_name", "eval_interval", "eval_before_train", "pack_size", "pack_policy",
        "shared_prompts", "sm_carveout", "overlap_sampling", "pause_sampling_rows")},
}
""":class:`TrainerConfig`'s fields and the keys they are read from."""

# SkyRL's Tracking backends that trainer.logger takes (mlflow and swanlab need servers or accounts).
LOGGERS = ("console", "tensorboard", "wandb")


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer's settings, read from SkyRL's keys where SkyRL has one (:data:`TRAINER_KEYS`) and from the
    plugin's own ``trainer.`` keys otherwise."""

    lr: float
    lr_schedule: str
    warmup_steps: int
    micro_batch_size: int
    weight_decay: float
    max_grad_norm: float
    algorithm: dict[str, Any]
    pack_size: int = 0
    pack_policy: str = "ready"
    shared_prompts: bool = True
    sm_carveout: int = 0
    overlap_sampling: bool | None = None
    pause_sampling_rows: int = 256
    max_tokens_per_microbatch: int = -1
    ckpt_interval: int = 10
    ckpt_path: str | None = None
    max_ckpts_to_keep: int = 2
    resume_mode: str = "latest"
    resume_path: str | None = None
    logger: list[str] = field(default_factory=list)
    project_name: str = "skyrl-clora"
    run_name: str | None = None
    eval_interval: int = 5
    eval_before_train: bool = True

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
        if self.resume_path is not None and not Path(self.resume_path).is_dir():
            raise ConfigError(f"trainer.resume_path={self.resume_path} is not a folder; point it at an earlier run's "
                              "trainer.ckpt_path")
        check_algorithm(self.algorithm)
        if self.max_tokens_per_microbatch == 0 or self.max_tokens_per_microbatch < -1:
            raise ConfigError(f"trainer.max_tokens_per_microbatch={self.max_tokens_per_microbatch} must be -1 (micro-batches "
                              "of trainer.micro_train_batch_size_per_gpu rows) or a positive token count")
        if not 0 <= self.sm_carveout < 128:
            raise ConfigError(f"trainer.sm_carveout={self.sm_carveout} must be in [0, 128) (SMs left free; 0: none)")
        if self.pack_policy not in PACK_POLICIES:
            raise ConfigError(f"trainer.pack_policy={self.pack_policy} is unknown; use {' or '.join(PACK_POLICIES)}")
        if self.pack_size < 0:
            raise ConfigError(f"trainer.pack_size must be >= 0 (0: one slot per tenant, up to 8), got {self.pack_size}")
        if self.lr_schedule not in SCHEDULERS.values():
            raise ConfigError(f"trainer.policy.optimizer_config.scheduler={self.lr_schedule} is unknown; use "
                              f"{' or '.join(SCHEDULERS)}")
        if self.micro_batch_size < 1:
            raise ConfigError(f"trainer.micro_train_batch_size_per_gpu must be >= 1, got {self.micro_batch_size}")


@dataclass(frozen=True)
class SamplerConfig:
    temperature: float
    top_p: float
    max_rows: int
    max_prefills_per_step: int
    prefill_block: int
    prefix_cache: bool
    cuda_graphs: bool
    gpu_memory_utilization: float
    kv_blocks: int
    reuse_decode_kv: bool | None
    stream_priority: str = "high"

    def __post_init__(self) -> None:
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
        if self.kv_blocks < 0:
            raise ConfigError(f"sampler.kv_blocks={self.kv_blocks} must be >= 0 (0: from the GPU memory plan)")


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs. ``tenants`` is expanded from ``+tenants=N`` or a list of overrides. ``steps`` (RL
    steps per tenant) is 0 until :func:`plan_steps` derives it from the training data, as SkyRL does from
    ``trainer.epochs`` and ``trainer.max_training_steps``."""

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
    tenants: tuple[TenantSpec, ...]
    identity: dict[str, Any]
    max_tenants: int = 0
    control: bool = True
    steps: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("concurrent", "serial"):
            raise ConfigError(f"clora.mode={self.mode} is unknown; use concurrent or serial")
        if self.train_mode not in ("swap", "packed"):
            raise ConfigError(f"clora.train_mode={self.train_mode} is unknown; use swap or packed")
        if self.mode == "serial" and self.backend != "embedded":
            raise ConfigError("backend=skyrl runs tenants concurrently on one stack; set clora.mode=concurrent "
                              "(serial mode is the embedded backend's baseline)")
        if self.trainer.pack_policy == "lockstep" and self.train_mode != "packed":
            raise ConfigError("trainer.pack_policy=lockstep forms packed passes; it needs clora.train_mode=packed")
        if self.train_mode == "packed" and self.backend != "embedded":
            raise ConfigError("clora.train_mode=packed needs backend=embedded; use clora.train_mode=swap")
        if self.trainer.overlap_sampling is False and self.backend != "embedded":
            raise ConfigError("trainer.overlap_sampling=false needs backend=embedded (backend=skyrl's servers keep sampling); "
                              "remove the override")
        if self.epochs < 1:
            raise ConfigError(f"trainer.epochs must be >= 1, got {self.epochs}")
        if self.max_training_steps is not None and self.max_training_steps < 1:
            raise ConfigError(f"trainer.max_training_steps must be >= 1 (or null), got {self.max_training_steps}")
        if self.max_tenants < 0:
            raise ConfigError(f"clora.max_tenants={self.max_tenants} must be >= 0 (0: the tenants the run starts with)")
        if self.backend not in ("embedded", "skyrl"):
            raise ConfigError(f"backend={self.backend} is unknown; use backend=embedded or backend=skyrl")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"clora.device={self.device} is unknown; use auto, cpu or cuda")
        if self.model_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype={self.model_dtype} is unknown; use auto, float32, bfloat16 or float16")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ConfigError(f"trainer.policy.model.path={self.model_path} is not a Hugging Face model folder (no "
                              "config.json); fix the path")
        if self.model_path is None:
            from skyrl_clora.recipes.plugin import load_corpus

            load_corpus(self.model_corpus)
        for spec in self.tenants:
            if spec.rank > self.lora.max_rank:
                raise ConfigError(
                    f"tenant {spec.name} has lora rank {spec.rank} > sampler.max_lora_rank={self.lora.max_rank}; "
                    "lower its rank or raise sampler.max_lora_rank"
                )
        _check_writable(self.output_dir)

    @property
    def tenant_capacity(self) -> int:
        """How many tenants the services are built for: ``clora.max_tenants`` or, when it is less (0), the
        tenants the run starts with."""
        return max(self.max_tenants, len(self.tenants))


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(f"clora.output_dir={path} is not writable ({error.strerror}); choose another directory") from None


def config_section(cls: type, node: DictConfig, prefix: str) -> Any:
    """Builds dataclass ``cls`` from ``node``, each value checked against its field's type (``checked``);
    unknown keys are an error naming the valid ones, and so are missing ones."""
    return typed_dataclass(cls, OmegaConf.to_container(node, resolve=True), prefix)


def typed_dataclass(cls: type, values: dict[str, Any], prefix: str, valid: set[str] | None = None,
                    **built: Any) -> Any:
    """``cls(**values, **built)``, each of ``values`` checked against its field's type; a key of ``values``
    that is no field (or, when given, not in ``valid``: the keys the error lists) is a :class:`ConfigError`
    naming the valid keys, and so is a missing one."""
    names = {f.name for f in fields(cls)} - set(built)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix}.{unknown[0]}; valid keys: {', '.join(sorted(valid or names))}")
    hints = get_type_hints(cls)
    typed, problems = {}, []
    for name, value in values.items():  # every field's type problem, one line each
        try:
            typed[name] = checked(value, hints[name], f"{prefix}.{name}")
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return cls(**typed, **built)
    except TypeError as error:
        raise ConfigError(f"{prefix}: {error}") from None


def read_keys(cfg: DictConfig, keys: dict[str, str]) -> dict[str, Any]:
    """``{field: value of key}`` for each ``field: key`` of ``keys`` present in ``cfg``."""
    values = {}
    for name, key in keys.items():
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT:
            values[name] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return values


_ABSENT = object()


def typed_fields(cls: type, values: dict[str, Any], keys: dict[str, str], **built: Any) -> Any:
    """``cls(**values, **built)``, each value checked against its field's type and named by its key in ``keys``
    in errors (every problem, one line each)."""
    hints = get_type_hints(cls)
    typed, problems = {}, []
    for name, value in values.items():
        try:
            typed[name] = checked(value, hints[name], keys[name])
        except ConfigError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return cls(**typed, **built)
    except TypeError as error:
        raise ConfigError(f"{cls.__name__}: {error}") from None


def _paths(value: Any, key: str) -> tuple[str, ...]:
    """SkyRL's data list (a path or a list of paths; null or [] for none), user-expanded."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(path, str) for path in value):
        raise ConfigError(f"{key}={value!r} must be a list of parquet files, e.g. {key}=['~/data/gsm8k/train.parquet']")
    return tuple(os.path.expanduser(path) for path in value)


def recipe_config(cfg: DictConfig) -> RecipeConfig:
    """The recipe's keys (:data:`RECIPE_KEYS`) as a :class:`RecipeConfig`, for the recipe serving
    ``environment.env_class`` (none: a :class:`ConfigError` listing the env classes served); the rest of the
    ``recipe`` node is that recipe's options."""
    from skyrl_clora.recipes.plugin import load_recipe, recipe_for_env

    values = read_keys(cfg, RECIPE_KEYS)
    if values["max_input_length"] is None:  # SkyRL's default: the prompt length bound
        values["max_input_length"] = cfg.trainer.max_prompt_length
    name = recipe_for_env(str(values["env_class"]))
    for field_name in ("train_data", "val_data"):
        values[field_name] = _paths(values[field_name], RECIPE_KEYS[field_name])
    options_type = load_recipe(name).options_type
    own = OmegaConf.to_container(cfg.recipe, resolve=True)
    common = {"task_variant", "eval_prompts"}
    options = typed_dataclass(options_type, {k: v for k, v in own.items() if k not in common}, "recipe",
                              common | {f.name for f in fields(options_type)})
    return typed_fields(RecipeConfig, values, RECIPE_KEYS, name=name, options=options)


def trainer_config(cfg: DictConfig) -> TrainerConfig:
    """:data:`TRAINER_KEYS` as a :class:`TrainerConfig`; SkyRL's ``trainer.logger`` may be one name or a list,
    its ``trainer.resume_mode`` null (none), its scheduler one of :data:`SCHEDULERS`."""
    values = read_keys(cfg, TRAINER_KEYS)
    if isinstance(values.get("logger"), str):
        values["logger"] = [values["logger"]]
    if values.get("resume_mode", "") is None:
        values["resume_mode"] = "none"
    scheduler = values["lr_schedule"]
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"trainer.policy.optimizer_config.scheduler={scheduler} is not implemented here; use "
                          f"{' or '.join(SCHEDULERS)}")
    values["lr_schedule"] = SCHEDULERS[scheduler]
    temperature = cfg.generator.sampling_params.temperature
    if values["algorithm"].get("temperature") is None and isinstance(temperature, (int, float)):
        values["algorithm"]["temperature"] = temperature  # as SkyRL's SkyRLTrainConfig.__post_init__ does
    return typed_fields(TrainerConfig, values, TRAINER_KEYS)


def lora_config(cfg: DictConfig) -> LoraConfig:
    keys = {"rank": "trainer.policy.model.lora.rank", "alpha": "trainer.policy.model.lora.alpha",
            "max_rank": "sampler.max_lora_rank"}
    return typed_fields(LoraConfig, read_keys(cfg, keys), keys)


def sampler_config(cfg: DictConfig) -> SamplerConfig:
    keys = {"temperature": "generator.sampling_params.temperature", "top_p": "generator.sampling_params.top_p",
            **{f.name: f"sampler.{f.name}" for f in fields(SamplerConfig) if f.name not in ("temperature", "top_p")}}
    own = set(OmegaConf.to_container(cfg.sampler)) - {key.split(".", 1)[1] for key in keys.values()} - {"max_lora_rank"}
    if own:
        raise ConfigError(f"unknown key sampler.{sorted(own)[0]}; see python -m skyrl_clora.main --help")
    return typed_fields(SamplerConfig, read_keys(cfg, keys), keys)


def tenant_specs(cfg: DictConfig, lora: LoraConfig, trainer: TrainerConfig, recipe: RecipeConfig) -> list[TenantSpec]:
    """The run's tenants from ``tenants`` (absent: 1), with the config's seed, lr, LoRA and recipe defaults."""
    value = cfg.get("tenants", 1)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    try:
        seed = checked(cfg.trainer.seed, int, "trainer.seed")
        return expand_tenants(value, **tenant_defaults(seed, lora, trainer, recipe))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def tenant_defaults(seed: int, lora: LoraConfig, trainer: TrainerConfig, recipe: RecipeConfig) -> dict[str, Any]:
    """What a tenant's spec takes from the config where its overrides are silent (``expand_tenants``' keywords);
    ``seed`` is the first tenant's."""
    return {"seed": seed, "lr": trainer.lr, "rank": lora.rank, "alpha": lora.alpha,
            "task_variant": recipe.task_variant, "samples_per_prompt": recipe.samples_per_prompt}


# Keys that do not change a run's results: where it writes, what it prints, how it checkpoints and resumes.
NOT_IDENTITY = frozenset({
    "clora.output_dir", "clora.progress", "clora.control", "trainer.logger", "trainer.project_name", "trainer.run_name",
    "trainer.ckpt_interval", "trainer.ckpt_path", "trainer.max_ckpts_to_keep",
    "trainer.resume_mode", "trainer.resume_path",
})


def flat_config(cfg: DictConfig) -> dict[str, Any]:
    """Every key of the composed config but ``tenants``, flattened: ``group.key`` (``trainer.algorithm.x``): value."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    walk({k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "tenants"}, "")
    return flat


def run_identity(cfg: DictConfig, tenants: list[TenantSpec]) -> dict[str, Any]:
    """Every key of the composed config that changes results, flattened (``group.key``: value), with the tenants
    as expanded specs (``+tenants=2`` and the list it stands for are the same run)."""
    flat = {key: value for key, value in flat_config(cfg).items() if key not in NOT_IDENTITY}
    for spec in tenants:
        flat[f"tenants.{spec.name}"] = asdict(spec)
    return json.loads(json.dumps(flat))  # as it reads back from run_config.json


def build_run_config(cfg: DictConfig) -> RunConfig:
    """Validates the composed Hydra config and returns the run's :class:`RunConfig` (``steps`` still 0: see
    :func:`plan_steps`). The groups are checked independently and every group's problem is reported at once: a
    :class:`ConfigError` of one line per problem."""
    problems: list[str] = []

    def section(build: Callable[[], Any]) -> Any:
        try:
            return build()
        except ConfigError as error:
            problems.append(str(error))
            return None

    clora = cfg.clora
    lora = section(lambda: lora_config(cfg))
    trainer = section(lambda: trainer_config(cfg))
    recipe = section(lambda: recipe_config(cfg))
    sampler = section(lambda: sampler_config(cfg))
    scalars = section(lambda: {
        "epochs": checked(cfg.trainer.epochs, int, "trainer.epochs"),
        "max_training_steps": checked(cfg.trainer.max_training_steps, int | None, "trainer.max_training_steps"),
        "seed": checked(cfg.trainer.seed, int, "trainer.seed"),
        "progress": checked(clora.progress, bool, "clora.progress"),
        "max_tenants": checked(clora.max_tenants, int, "clora.max_tenants"),
        "control": checked(clora.control, bool, "clora.control"),
    })
    if problems:
        raise ConfigError("\n".join(problems))
    tenants = tenant_specs(cfg, lora, trainer, recipe)
    model_path = cfg.trainer.policy.model.path
    return RunConfig(
        mode=str(clora.mode), train_mode=str(clora.train_mode), output_dir=Path(os.path.expanduser(str(clora.output_dir))),
        device=str(clora.device), backend=str(cfg.backend.name),
        model_path=None if model_path is None else os.path.expanduser(str(model_path)),
        model_dtype=str(cfg.model.dtype), model_corpus=model_corpus(cfg.model.corpus, recipe), recipe=recipe,
        lora=lora, trainer=trainer, sampler=sampler, tenants=tuple(tenants), identity=run_identity(cfg, tenants),
        **scalars,
    )


def model_corpus(corpus: str | None, recipe: RecipeConfig) -> str:
    """``model.corpus``, or when null the run's recipe if it offers a pre-training corpus, else ``gsm8k``."""
    if corpus is not None:
        return str(corpus)
    from skyrl_clora.recipes.plugin import load_recipe

    return recipe.name if hasattr(load_recipe(recipe.name), "pretraining_episodes") else "gsm8k"


def planned_steps(epochs: int, max_training_steps: int | None, train_rows: int, batch_size: int) -> int:
    """SkyRL's step count: ``epochs`` passes of ``train_rows // batch_size`` steps (its dataloader drops the last
    partial batch), at most ``max_training_steps``; a :class:`ConfigError` when that is no step."""
    steps = epochs * (train_rows // batch_size)
    if max_training_steps is not None:
        steps = min(steps, max_training_steps)
    if steps < 1:
        raise ConfigError(f"the training data holds {train_rows} rows, fewer than trainer.train_batch_size={batch_size}; "
                          "lower trainer.train_batch_size or add rows to data.train_data")
    return steps


def plan_steps(run: RunConfig, train_rows: int) -> RunConfig:
    """``run`` with its RL steps per tenant (:func:`planned_steps`) for a training set of ``train_rows`` rows."""
    return replace(run, steps=planned_steps(run.epochs, run.max_training_steps, train_rows, run.recipe.prompts_per_step))
