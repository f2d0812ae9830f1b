"""Composing the config tree of ``conf/`` (:mod:`skyrl_clora.config.compose`): every conf file composes and each of
its keys has its value in the composed config; any key of SkyRL's own tree is overridable without a ``+``; a
SkyRL-style command (a model path, no plugin key) composes, through SkyRL's own builder, the config SkyRL's
``SkyRLTrainConfig()`` is, but for the deliberate exceptions listed here with their reasons, and the tiny demo (no
model path) differs from SkyRL's defaults only where its own files say so; the usage lines of the config groups and
the one-line errors of a bad group choice or an unknown key."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.config.config import build_nested_dataclass

from skyrl_clora.backends.skyrl.config_translation import skyrl_tree
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.compose import CONF_DIR, check_known_keys, compose_config, config_groups
from skyrl_clora.config.help import conf_keys, is_global
from skyrl_clora.config.schema import ConfigError
from skyrl_clora.config.skyrl_cli import preset_overrides


def _yaml_files() -> list[Path]:
    return sorted(CONF_DIR.rglob("*.yaml"))


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_every_conf_file_composes(path: Path, tmp_path: Path) -> None:
    relative = path.relative_to(CONF_DIR)
    overrides = [f"clora.output_dir={tmp_path}"]
    if relative.parent != Path("."):
        overrides.append(f"{relative.parent}={relative.stem}")
    cfg = compose_config(overrides)
    content = yaml.safe_load(path.read_text()) or {}  # preset/skyrl.yaml: comments only
    if relative.parent != Path(".") and not is_global(path):
        assert dict(cfg[str(relative.parent)]) == content
    else:  # every key the file sets has its value in the composed config
        for key, value in flat(content).items():
            if not key.startswith("defaults") and relative.parent != Path("."):
                if isinstance(value, str) and value.startswith("${"):  # an interpolation: the key it names
                    value = OmegaConf.select(cfg, value[2:-1])
                assert OmegaConf.select(cfg, key) == value, key
        assert {key for key in content if key != "defaults"} <= set(cfg)
    assert build_run_config(cfg).tenants


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_skyrl_key_is_a_known_key() -> None:
    """Any key of SkyRL's SkyRLTrainConfig is overridable without a ``+`` (SkyRL's own tree is in the config)."""
    from skyrl_clora.config.keys import skyrl_defaults
    from skyrl_clora.config.compose import check_known_keys, compose_config

    keys = [key for key, value in flat(skyrl_defaults()).items() if isinstance(value, (int, float, str))]
    assert len(keys) > 300
    overrides = [f"{key}={skyrl_defaults_value(key)}" for key in keys[::7]] + ["recipe=taubench", "+tenants=2"]
    cfg = compose_config(overrides)
    check_known_keys(cfg, overrides)
    assert all(OmegaConf.select(cfg, key) is not None for key in keys[::7])


def skyrl_defaults_value(key: str) -> str:
    from skyrl_clora.config.keys import skyrl_defaults

    value = flat(skyrl_defaults())[key]
    return str(value).lower() if isinstance(value, bool) else f"'{value}'" if isinstance(value, str) else str(value)


EXCEPTIONS = {
    "trainer.policy.model.path": "the command's own model (SkyRL's default is the hub id Qwen/Qwen2.5-1.5B-Instruct)",
    "trainer.policy.model.lora.rank": "16: each tenant is a LoRA adapter, and SkyRL's 0 turns LoRA off",
    "trainer.policy.model.lora.max_loras": "null, the tenants sampling at once: SkyRL's 1 serves one tenant per batch",
    "trainer.policy.model.lora.lora_sync_path": "null, <clora.output_dir>/lora_sync: SkyRL's /tmp/skyrl_lora_sync would "
                                                "be shared by every run",
    "trainer.ckpt_path": "null, <clora.output_dir>/checkpoints: SkyRL's /root/ckpts/ would be shared by every run",
    "data.train_data": "[], the recipe's synthetic rows: SkyRL's default is its example's /root/data/gsm8k files",
    "data.val_data": "[], the recipe's synthetic held-out rows (as data.train_data)",
}
"""Every SkyRL key whose default differs on a SkyRL-style command, with why (conf/config.yaml says the same)."""

SKYRL_BACKEND_EXCEPTIONS = {
    "trainer.placement.colocate_all": "false: adapter-only in-place sync without pausing generation needs the servers "
                                      "awake (conf/backend/skyrl.yaml)",
    "trainer.policy.megatron_config.lora_config.merge_lora": "false: each tenant's adapter is loaded under its own "
                                                             "name; merging one into the base leaves no room for others",
}
"""backend=skyrl's further exceptions."""


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        return {key: value for name, child in node.items() for key, value in _flat(child, f"{prefix}{name}.").items()}
    return {prefix[:-1]: node}


def _differences(overrides: list[str]) -> dict[str, tuple[Any, Any]]:
    """``{key: (composed, SkyRL's)}`` for every SkyRL key where SkyRL's builder over the composed config (with the
    entry point's preset rule) differs from ``SkyRLTrainConfig()``."""
    tree = skyrl_tree(compose_config(preset_overrides(overrides)))
    composed, skyrl = _flat(asdict(build_nested_dataclass(SkyRLTrainConfig, tree))), _flat(asdict(SkyRLTrainConfig()))
    assert set(composed) == set(skyrl)
    return {key: (composed[key], skyrl[key]) for key in skyrl if composed[key] != skyrl[key]}


@pytest.mark.parametrize("backend, exceptions", [("embedded", EXCEPTIONS),
                                                 ("skyrl", {**EXCEPTIONS, **SKYRL_BACKEND_EXCEPTIONS})])
def test_a_skyrl_command_gets_skyrls_defaults(backend: str, exceptions: dict[str, str], tmp_path: Path) -> None:
    differences = _differences([f"trainer.policy.model.path={tmp_path}", f"backend={backend}"])
    assert set(differences) == set(exceptions), {k: v for k, v in differences.items() if k not in exceptions}


def test_the_demo_differs_from_skyrl_only_where_its_files_say() -> None:
    """No model path: the demo preset; each key it moves off SkyRL's default is one of its files' (the preset's and
    its recipe's) or an exception; and it moves some (the check can fail)."""
    own = {key.path for name in ("preset/demo.yaml", "recipe/gsm8k.yaml") for key in conf_keys(CONF_DIR / name)}
    # SkyRL's __post_init__s: trainer.max_prompt_length and the training max_generate_length, which the demo sets
    derived = {"generator.max_input_length", "generator.eval_sampling_params.max_generate_length"}
    differences = _differences([])
    assert set(differences) - set(EXCEPTIONS) - derived <= own
    assert {"trainer.policy.optimizer_config.lr", "trainer.train_batch_size", "environment.env_class"} <= set(differences)


def test_the_usage_lines_list_each_group_with_its_options() -> None:
    assert config_groups().splitlines() == ["  backend=embedded|skyrl", "  model=tiny", "  preset=demo|skyrl",
                                            "  recipe=gsm8k|skyrl|skyrl_gsm8k|taubench"]


@pytest.mark.parametrize("overrides, message", [
    (["recipe=nope"], r"Could not find 'recipe/nope'; choose recipe= one of gsm8k, skyrl, skyrl_gsm8k, taubench$"),
    (["clora.outptu_dir=3"], r"^unknown key clora.outptu_dir; did you mean clora.output_dir( or [\w.]+)*\? "
                             r"\(a key the config does not have is added with \+key=value\)$"),
    (["recipe=taubench", "recipe.zzz_qqq=1"], r"^unknown key recipe.zzz_qqq; see python -m skyrl_clora.main --help"),
])
def test_a_bad_override_is_one_line_naming_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        compose_config(overrides)
    assert "\n" not in str(error.value)


def test_a_key_added_with_a_plus_must_be_one_the_config_reads() -> None:
    overrides = ["recipe=taubench", "+recipe.nope=1"]
    with pytest.raises(ConfigError, match=r"^unknown key recipe.nope; valid keys here: .*\bdata_path\b"):
        check_known_keys(compose_config(overrides), overrides)
    check_known_keys(compose_config(["+tenants=2"]), ["+tenants=2"])
