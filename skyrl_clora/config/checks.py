"""What a run's configuration needs of the world around it, checked where the run is built (``config.build``):
the files, folders and recipe corpus it names, SkyRL's algorithm settings against SkyRL's own dataclass and
registries, and an output folder that can be made. Each raises :class:`~skyrl_clora.config.schema.ConfigError` with a
one-line fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_type_hints

from skyrl_clora.checkpoints import prepare_output_dir
from skyrl_clora.config.schema import RECIPE_KEYS, ConfigError, RunConfig, checked


def check_inputs(run: RunConfig) -> list[str]:
    """The problems with what ``run`` reads (its data files, the run it resumes from, its model folder, or without
    one the recipe corpus the tiny base is pre-trained on at first use), one line each."""
    problems = [f"{RECIPE_KEYS[name]}: {path} does not exist; point it at an existing file"
                for name in ("train_data", "val_data") for path in getattr(run.recipe, name) if not Path(path).exists()]
    if run.trainer.resume_path is not None and not Path(run.trainer.resume_path).is_dir():
        problems.append(f"trainer.resume_path={run.trainer.resume_path} is not a folder; point it at an earlier "
                        "run's trainer.ckpt_path")
    if run.model_path is not None and not (Path(run.model_path) / "config.json").is_file():
        problems.append(f"trainer.policy.model.path={run.model_path} is not a Hugging Face model folder (no "
                        "config.json); fix the path")
    if run.model_path is None:
        from skyrl_clora.recipes.plugin import load_corpus

        try:
            load_corpus(run.model_corpus)
        except ConfigError as error:
            problems.append(str(error))
    return problems


def algorithm_config(algorithm: dict[str, Any]) -> Any:
    """SkyRL's ``AlgorithmConfig`` built from ``trainer.algorithm`` (nested configs included)."""
    from skyrl.train.config import AlgorithmConfig
    from skyrl.train.config.config import build_nested_dataclass

    return build_nested_dataclass(AlgorithmConfig, algorithm)


KL_ESTIMATORS = ("k1", "k2", "k3", "abs")  # SkyRL's compute_approx_kl


def check_algorithm(algorithm: dict[str, Any]) -> None:
    """``trainer.algorithm`` as SkyRL's ``AlgorithmConfig`` takes it, with an advantage estimator and a policy loss
    that SkyRL's registries hold (a custom one registered before the run counts) and KL options SkyRL accepts and
    the plugin honours (``use_kl_loss`` or ``use_kl_in_reward`` with a controller SkyRL's ``get_kl_controller``
    builds, ``kl_loss_coef``, ``kl_estimator_type``) and a loss reduction SkyRL runs (``max_seq_len`` set for
    ``seq_mean_token_sum_norm``); else a :class:`ConfigError`."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry
    from skyrl.train.config import AlgorithmConfig

    hints = get_type_hints(AlgorithmConfig)
    for key, value in algorithm.items():
        hint = hints.get(key)
        if hint in (int, float, bool, str) or hint in (int | None, float | None, bool | None, str | None):
            checked(value, hint, f"trainer.algorithm.{key}")
    try:
        config = algorithm_config(algorithm)
    except (TypeError, ValueError, AssertionError) as error:
        raise ConfigError(f"trainer.algorithm: {str(error).splitlines()[0]}") from None
    from skyrl_clora.trainer.loss_reduction import loss_reduction_problem

    problem = loss_reduction_problem(config)
    if problem is not None:
        raise ConfigError(problem)
    if config.kl_estimator_type not in KL_ESTIMATORS:
        raise ConfigError(f"trainer.algorithm.kl_estimator_type={config.kl_estimator_type} is unknown; use one of "
                          f"{', '.join(KL_ESTIMATORS)}")
    if config.use_kl_in_reward and config.use_kl_loss:
        raise ConfigError("trainer.algorithm.use_kl_in_reward and use_kl_loss are mutually exclusive (SkyRL's rule); "
                          "set one of them to false")
    if config.use_kl_in_reward:
        from skyrl.backends.skyrl_train.utils.ppo_utils import get_kl_controller

        try:
            get_kl_controller(config)  # SkyRL's own checks of kl_ctrl
        except ValueError as error:
            raise ConfigError(f"trainer.algorithm.kl_ctrl: {error}; fix kl_ctrl.type (fixed or adaptive) or "
                              "kl_ctrl.horizon") from None
    for key, registry in (("advantage_estimator", AdvantageEstimatorRegistry), ("policy_loss_type", PolicyLossRegistry)):
        available = registry.list_available()
        if key in algorithm and algorithm[key] not in available:
            raise ConfigError(f"trainer.algorithm.{key}={algorithm[key]} is not in SkyRL's registry; use one of "
                              f"{', '.join(sorted(available))} (or register yours with SkyRL before the run)")


def check_output_dir(path: Path) -> None:
    """Refuses (:class:`ConfigError`) a ``clora.output_dir`` that cannot be made or written, and leaves nothing
    behind: the folders this check makes to find out (``path`` and those above it that were missing) are removed
    again."""
    made = [folder for folder in (path, *path.parents) if not folder.exists()]
    try:
        prepare_output_dir(path)
    finally:
        for folder in made:  # deepest first
            if folder.is_dir():
                folder.rmdir()
