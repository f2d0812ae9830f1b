"""Composing the Hydra config tree of ``conf/`` (SkyRL's key tree included) from a command line's overrides.

Hydra's compose API is used rather than ``@hydra.main``, so that bad input becomes a one-line
:class:`~skyrl_clora.config.schema.ConfigError` (exit status 2) instead of a traceback.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from skyrl_clora.config.schema import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"


def config_groups() -> str:
    """The usage lines of the config groups: ``  <group>=<option>|<option>...``, one per folder of ``conf/``."""
    lines = []
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        lines.append(f"  {group.name}={'|'.join(options)}")
    return "\n".join(lines)


def compose_config(overrides: list[str]):
    """Composes conf/ (SkyRL's key tree included) with ``overrides``; Hydra/OmegaConf errors become one-line
    errors (:class:`~skyrl_clora.config.schema.ConfigError`)."""
    from skyrl_clora.config.keys import register_skyrl_defaults

    register_skyrl_defaults()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        message = str(error).strip().splitlines()[0]
        missing_group = re.search(r"Could not find '(\w+)/", message)
        if missing_group and (CONF_DIR / missing_group.group(1)).is_dir():
            options = sorted(f.stem for f in (CONF_DIR / missing_group.group(1)).glob("*.yaml"))
            message += f"; choose {missing_group.group(1)}= one of {', '.join(options)}"
        if "tenants" in message and "+tenants" not in " ".join(overrides):
            message += " (write +tenants=N: tenants is added with a leading '+')"
        unknown = re.search(r"Could not override '([\w.]+)'", message)
        if unknown and unknown.group(1) != "tenants":
            message = _unknown_key_message(unknown.group(1), overrides)
        raise ConfigError(message) from None


def _unknown_key_message(key: str, overrides: list[str]) -> str:
    """One line for an override of a key the config does not have: the closest valid keys."""
    import difflib

    from skyrl_clora.config.build import flat_config

    known = list(flat_config(_group_defaults(overrides)))
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else "see python -m skyrl_clora.main --help for the keys"
    return f"unknown key {key}; {hint} (a key the config does not have is added with +key=value)"


def _group_defaults(overrides: list[str]) -> DictConfig:
    """The config composed with the group choices of ``overrides`` alone (``recipe=``, ``backend=``, ...): every key
    with its default. Read-only; composed once per set of choices."""
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    return _composed_defaults(tuple(o for o in overrides if o.split("=", 1)[0] in groups))


@functools.cache
def _composed_defaults(choices: tuple[str, ...]) -> DictConfig:
    cfg = compose_config(list(choices))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def check_known_keys(cfg: DictConfig, overrides: list[str]) -> None:
    """Raises :class:`~skyrl_clora.config.schema.ConfigError` for a key that ``+key=value`` added and nothing reads: every key of ``cfg`` but
    ``tenants`` must be in the config composed with the same group choices alone (``recipe=``, ``backend=``, ...),
    which holds SkyRL's whole key tree."""
    from skyrl_clora.config.keys import FREE_FORM_KEYS

    defaults = _group_defaults(overrides)

    def walk(node: DictConfig, known: DictConfig, prefix: str) -> None:
        for key in node:
            path = f"{prefix}{key}"
            if path == "tenants":
                continue
            if key not in known:
                valid = ", ".join(sorted(str(k) for k in known))
                raise ConfigError(f"unknown key {path}; valid keys{' here' if prefix else ''}: {valid}")
            if OmegaConf.is_dict(node[key]) and OmegaConf.is_dict(known[key]) and path not in FREE_FORM_KEYS:
                walk(node[key], known[key], f"{path}.")

    walk(cfg, defaults, "")
