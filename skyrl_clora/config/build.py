"""The composed Hydra config read into the run's :class:`~skyrl_clora.config.schema.RunConfig`: SkyRL's keys where SkyRL has
one (:data:`TRAINER_KEYS`, :data:`~skyrl_clora.config.schema.RECIPE_KEYS`, ...), the plugin's own keys otherwise.

Every problem is a :class:`~skyrl_clora.config.schema.ConfigError` of one line naming the key as the user writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

from omegaconf import DictConfig, OmegaConf

from skyrl_clora.config.schema import (
    KV_CACHE_DTYPE_KEY, RECIPE_KEYS, ConfigError, EvalConfig, LoraConfig, RecipeConfig, RunConfig, SamplerConfig,
    OPTIMIZER_FIELDS, PLUGIN_TRAINER_FIELDS, TrainerConfig, checked,
)
from skyrl_clora.config.checks import check_algorithm, check_inputs, check_output_dir
from skyrl_clora.tenants import PER_TENANT_SKYRL, TenantSpec, expand_tenants

TRAINER_KEYS = {
    f.name: (f"trainer.policy.optimizer_config.{f.name}" if f.name in OPTIMIZER_FIELDS
             else f"clora.{f.name}" if f.name in PLUGIN_TRAINER_FIELDS else f"trainer.{f.name}")
    for f in fields(TrainerConfig)
}
""":class:`TrainerConfig`'s fields and the keys they are read from."""


def typed_dataclass(cls: type, values: dict[str, Any], prefix: str, valid: set[str] | None = None,
                    **built: Any) -> Any:
    """``cls(**values, **built)``, each of ``values`` checked against its field's type; a key of ``values``
    that is no field (or, when given, not in ``valid``: the keys the error lists) is a :class:`ConfigError`
    naming the valid keys, and so is a missing one."""
    names = {f.name for f in fields(cls)} - set(built)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix}.{unknown[0]}; valid keys: {', '.join(sorted(valid or names))}")
    return typed_fields(cls, values, {name: f"{prefix}.{name}" for name in values}, **built)


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
    its ``trainer.resume_mode`` null (none)."""
    values = read_keys(cfg, TRAINER_KEYS)
    if isinstance(values.get("logger"), str):
        values["logger"] = [values["logger"]]
    if values.get("resume_mode", "") is None:
        values["resume_mode"] = "none"
    temperature = cfg.generator.sampling_params.temperature
    if values["algorithm"].get("temperature") is None and isinstance(temperature, (int, float)):
        values["algorithm"]["temperature"] = temperature  # as SkyRL's SkyRLTrainConfig.__post_init__ does
    trainer = typed_fields(TrainerConfig, values, TRAINER_KEYS)
    check_algorithm(trainer.algorithm)
    return trainer


def lora_config(cfg: DictConfig) -> LoraConfig:
    keys = {"rank": "trainer.policy.model.lora.rank", "alpha": "trainer.policy.model.lora.alpha",
            "max_lora_rank": "sampler.max_lora_rank"}
    return typed_fields(LoraConfig, read_keys(cfg, keys), keys)


def sampler_config(cfg: DictConfig) -> SamplerConfig:
    skyrl = {"temperature": "generator.sampling_params.temperature", "top_p": "generator.sampling_params.top_p",
             "kv_cache_dtype": KV_CACHE_DTYPE_KEY,
             "enable_prefix_caching": "generator.inference_engine.enable_prefix_caching"}
    keys = {**skyrl, **{f.name: f"sampler.{f.name}" for f in fields(SamplerConfig) if f.name not in skyrl}}
    own = set(OmegaConf.to_container(cfg.sampler)) - {key.split(".", 1)[1] for key in keys.values()} - {"max_lora_rank"}
    if own:
        raise ConfigError(f"unknown key sampler.{sorted(own)[0]}; see python -m skyrl_clora.main --help")
    return typed_fields(SamplerConfig, read_keys(cfg, keys), keys)


EVAL_SAMPLING_KEY = "generator.eval_sampling_params"


def eval_config(cfg: DictConfig) -> EvalConfig:
    """SkyRL's evaluation keys as an :class:`EvalConfig`: ``generator.eval_sampling_params`` built as SkyRL's
    ``SamplingParams`` (null: SkyRL's default, greedy at ``generator.sampling_params.max_generate_length``; the
    composed config's default says the same) and ``generator.eval_n_samples_per_prompt``."""
    from skyrl.train.config import SamplingParams

    node = OmegaConf.select(cfg, EVAL_SAMPLING_KEY)
    if node is None:
        values = {"temperature": 0.0, "max_generate_length": cfg.generator.sampling_params.max_generate_length}
    else:
        values = OmegaConf.to_container(node, resolve=True)
    hints = get_type_hints(SamplingParams)
    for name in ("max_generate_length", "temperature", "top_p"):
        if name in values:
            values[name] = checked(values[name], hints[name], f"{EVAL_SAMPLING_KEY}.{name}")
    samples = checked(cfg.generator.eval_n_samples_per_prompt, int, "generator.eval_n_samples_per_prompt")
    return EvalConfig(asdict(SamplingParams(**values)), samples)


def tenant_specs(cfg: DictConfig, lora: LoraConfig, trainer: TrainerConfig, recipe: RecipeConfig) -> list[TenantSpec]:
    """The run's tenants from ``tenants`` (absent: 1), with the config's seed, lr, LoRA and recipe defaults."""
    value = cfg.get("tenants", 1)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    try:
        seed = checked(cfg.trainer.seed, int, "trainer.seed")
        specs = expand_tenants(value, **tenant_defaults(seed, lora, trainer, recipe))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    for spec in specs:
        check_tenant_overrides(spec, trainer, str(cfg.backend.name))
    return specs


def check_tenant_overrides(spec: TenantSpec, trainer: TrainerConfig, backend: str) -> None:
    """A :class:`ConfigError` (one line) unless the tenant's overrides of SkyRL keys (``tenants.PER_TENANT_SKYRL``) run
    on ``backend`` and its ``trainer.algorithm`` (the run's with its overrides) is one SkyRL takes."""
    given = [name for name in PER_TENANT_SKYRL if getattr(spec, name) is not None]
    if given and backend != "embedded":
        raise ConfigError(f"tenant {spec.name}: the override {given[0]} needs backend=embedded (SkyRL's policy workers "
                          f"share one config); set {PER_TENANT_SKYRL[given[0]]} for the run instead")
    overrides = spec.algorithm_overrides()
    from skyrl_clora.config.keys import rule_for

    for name, value in overrides.items():  # what the run's command line refuses, a tenant's override refuses too
        rule = rule_for(f"trainer.algorithm.{name}")
        if rule is not None and rule.accepts is not None and not rule.accepts(value, None):
            raise ConfigError(f"tenant {spec.name}: {name}={value}: {rule.detail}")
    if overrides:
        try:
            check_algorithm({**trainer.algorithm, **overrides})
        except ConfigError as error:
            raise ConfigError(f"tenant {spec.name}: {error}") from None


def tenant_defaults(seed: int, lora: LoraConfig, trainer: TrainerConfig, recipe: RecipeConfig) -> dict[str, Any]:
    """What a tenant's spec takes from the config where its overrides are silent (``expand_tenants``' keywords);
    ``seed`` is the first tenant's."""
    return {"seed": seed, "lr": trainer.lr, "rank": lora.rank, "alpha": lora.alpha,
            "task_variant": recipe.task_variant, "samples_per_prompt": recipe.samples_per_prompt}


# Keys that do not change a run's results: where it writes, what it prints, how it checkpoints and resumes.
NOT_IDENTITY = frozenset({
    "clora.output_dir", "clora.progress", "clora.control", "clora.replicas", "trainer.logger", "trainer.project_name",
    "trainer.run_name",
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
    """Validates the composed Hydra config, then the files and folders it names (:func:`check_inputs`), that the
    run's output folder can be made (:func:`check_output_dir`; nothing is created), and returns the run's
    :class:`RunConfig`, its steps not yet planned (:func:`plan_steps`). The groups are checked independently and every
    group's problem is reported at once, as are the input files' problems: a :class:`ConfigError` of one line per
    problem."""
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
    evaluation = section(lambda: eval_config(cfg))
    scalars = section(lambda: {
        "epochs": checked(cfg.trainer.epochs, int, "trainer.epochs"),
        "max_training_steps": checked(cfg.trainer.max_training_steps, int | None, "trainer.max_training_steps"),
        "seed": checked(cfg.trainer.seed, int, "trainer.seed"),
        "progress": checked(clora.progress, bool, "clora.progress"),
        "max_tenants": checked(clora.max_tenants, int, "clora.max_tenants"),
        "control": checked(clora.control, bool, "clora.control"),
        "replicas": checked(clora.replicas, int, "clora.replicas"),
    })
    if problems:
        raise ConfigError("\n".join(problems))
    tenants = tenant_specs(cfg, lora, trainer, recipe)
    model_path = cfg.trainer.policy.model.path
    run = RunConfig(
        mode=str(clora.mode), train_mode=str(clora.train_mode), output_dir=Path(os.path.expanduser(str(clora.output_dir))),
        device=str(clora.device), backend=str(cfg.backend.name),
        model_path=None if model_path is None else resolve_model_path(str(model_path)),
        model_dtype=str(cfg.model.dtype), model_corpus=model_corpus(cfg.model.corpus, recipe), recipe=recipe,
        lora=lora, trainer=trainer, sampler=sampler, evaluation=evaluation, tenants=tuple(tenants),
        identity=run_identity(cfg, tenants),
        **scalars,
    )
    problems = check_inputs(run)
    if problems:
        raise ConfigError("\n".join(problems))
    check_output_dir(run.output_dir)
    return run


def resolve_model_path(value: str) -> str:
    """``trainer.policy.model.path`` as a local folder, as SkyRL's ``from_pretrained`` reads it: a path that exists
    (``~`` expanded) as it is; else a Hugging Face hub id (``Qwen/Qwen3-0.6B``): its snapshot in huggingface_hub's
    cache, downloaded first unless the hub is offline (``HF_HUB_OFFLINE=1``). An id that cannot be had is a
    :class:`ConfigError` naming it and the fix; a value that is no hub id is returned expanded (``RunConfig`` then
    says it is not a model folder)."""
    path = os.path.expanduser(value)
    if os.path.exists(path):
        return path
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(value, local_files_only=True)
    except HFValidationError:
        return path
    except LocalEntryNotFoundError:
        pass
    fix = (f"download it where the hub is reachable (hf download {value}, with HF_HUB_CACHE pointing at this "
           "machine's cache) or set trainer.policy.model.path to a local model folder")
    if constants.is_offline_mode():
        raise ConfigError(f"trainer.policy.model.path={value} is neither a local folder nor in the Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}) and the hub is offline; {fix}")
    try:
        return snapshot_download(value)
    except (OSError, httpx.HTTPError) as error:  # hub errors are both; a missing repo, a network failure, ...
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise ConfigError(f"trainer.policy.model.path={value}: not a local folder, and downloading it from the "
                          f"Hugging Face hub failed ({reason}); {fix}") from None


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
    steps = planned_steps(run.epochs, run.max_training_steps, train_rows, run.recipe.prompts_per_step)
    return replace(run, planned_steps=steps)
