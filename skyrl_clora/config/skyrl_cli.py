"""SkyRL 0.4's command-line rewrites, applied to the overrides before the config is composed.

SkyRL's entry point (``SkyRLTrainConfig.from_cli_overrides``) does more than set keys: it drops
``generator.inference_engine.async_engine=true`` (the async HTTP path is the only one; ``false`` or any other value
is refused), renames the deprecated ``trainer.use_sample_packing`` to ``trainer.remove_microbatch_padding``, and
refuses the keys it removed with the replacement to use; parsing with ``OmegaConf.from_cli``, it takes any key
under its free-form dicts (``config.keys.FREE_FORM_KEYS``) without Hydra's ``+``; and it builds
``generator.eval_sampling_params`` from the keys given under it alone (:func:`eval_sampling_defaults`).
:func:`skyrl_cli_overrides` does the same to the plugin's command line, with SkyRL's reasons, so that a SkyRL command
means here what it means there.
:func:`preset_overrides` picks the preset a command means: SkyRL's defaults for a command naming its model.
"""

from __future__ import annotations

from dataclasses import asdict

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.config.keys import FREE_FORM_KEYS

ASYNC_ENGINE = "generator.inference_engine.async_engine"
SAMPLE_PACKING, MICROBATCH_PADDING = "trainer.use_sample_packing", "trainer.remove_microbatch_padding"

_ROPE = ("`rope_scaling`, `rope_theta`, and `rope_parameters` are no longer supported as native config overrides (SkyRL "
         "0.4); use generator.inference_engine.engine_init_kwargs.hf_overrides.rope_parameters and "
         "trainer.policy.model_config_kwargs.rope_parameters instead")
REMOVED = {
    "generator.inference_engine.enable_http_endpoint":
        "enable_http_endpoint is no longer supported (SkyRL 0.4 always uses the HTTP/vLLM inference path); remove it",
    "generator.inference_engine.override_existing_update_group":
        "override_existing_update_group is no longer supported (SkyRL 0.4 manages update groups); remove it",
    "generator.inference_engine.remote_urls":
        "remote_urls is no longer supported (SkyRL 0.4); use generator.inference_engine.external_proxy_url and "
        "external_server_urls",
    **{f"{prefix}.{name}": _ROPE
       for prefix in ("trainer", "generator", "generator.inference_engine",
                      "generator.inference_engine.engine_init_kwargs")
       for name in ("rope_scaling", "rope_theta", "rope_parameters")},
    **{f"generator.inference_engine.engine_init_kwargs.hf_overrides.{name}": _ROPE
       for name in ("rope_scaling", "rope_theta")},
}
"""Keys SkyRL 0.4's entry point refuses (``from_cli_overrides``), with its reason and fix."""


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def skyrl_cli_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` (Hydra's ``key=value``, ``+key=value``, ``~key``) as SkyRL 0.4's entry point reads them: an
    ``async_engine=true`` (any case) left out, ``use_sample_packing`` renamed ``remove_microbatch_padding``, a key
    under a free-form dict set with Hydra's ``++`` (added, or replaced if the config has it); a
    :class:`ConfigError` (one line per problem, SkyRL's reason) for ``async_engine`` with another value, both
    packing keys together, or a key SkyRL removed (:data:`REMOVED`); :func:`eval_sampling_defaults` first."""
    kept, problems = [], []
    keys = {_key(override) for override in overrides}
    for override in overrides:
        key = _key(override)
        value = override.split("=", 1)[1].strip() if "=" in override else ""
        if key == ASYNC_ENGINE:
            if value.lower() == "true":
                continue
            problems.append(f"{ASYNC_ENGINE}={value}: SkyRL 0.4 always uses the async HTTP/vLLM inference path "
                            f"({'async_engine=false is no longer supported' if value.lower() == 'false' else 'the key is gone'}); "
                            "remove the override")
        elif key in REMOVED:
            problems.append(f"{key}: {REMOVED[key]}")
        elif key == SAMPLE_PACKING:
            if MICROBATCH_PADDING in keys:
                problems.append(f"give only one of {SAMPLE_PACKING} (deprecated) and {MICROBATCH_PADDING} (SkyRL's rule)")
            kept.append(override.replace(SAMPLE_PACKING, MICROBATCH_PADDING, 1))
        elif not override.startswith(("+", "~")) and any(key.startswith(f"{d}.") for d in FREE_FORM_KEYS):
            kept.append(f"++{override}")
        else:
            kept.append(override)
    if problems:
        raise ConfigError("\n".join(problems))
    return [*eval_sampling_defaults(keys), *kept]


EVAL_SAMPLING = "generator.eval_sampling_params"


def eval_sampling_defaults(keys: set[str]) -> list[str]:
    """SkyRL's rule for ``generator.eval_sampling_params``, as overrides to put first: with no key under it given,
    none (the config's default is SkyRL's: greedy at the training length); with some given, SkyRL builds its
    ``SamplingParams`` from those alone, so every field not given is set to ``SamplingParams``' own default
    (temperature 1.0, max_generate_length 1024, ...)."""
    from skyrl.train.config import SamplingParams

    given = {key[len(EVAL_SAMPLING) + 1:].split(".")[0] for key in keys if key.startswith(f"{EVAL_SAMPLING}.")}
    if not given:
        return []
    defaults = asdict(SamplingParams())
    return [f"{EVAL_SAMPLING}.{name}={'null' if value is None else value}" for name, value in defaults.items()
            if name not in given]


MODEL_PATH = "trainer.policy.model.path"


def preset_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with ``preset=skyrl`` (SkyRL's defaults: conf/preset/skyrl.yaml) added when they name a
    ``trainer.policy.model.path`` (not null) and choose no ``preset``: a command for a model of its own means what
    it means to SkyRL. Without a model path the config's default preset, ``demo`` (the tiny demo), holds."""
    keys = {_key(override) for override in overrides}
    named = [override.split("=", 1)[1].strip() for override in overrides
             if _key(override) == MODEL_PATH and "=" in override and not override.startswith("~")]
    if "preset" in keys or not named or named[-1].lower() in ("", "null", "none", "~"):
        return overrides
    return [*overrides, "preset=skyrl"]
