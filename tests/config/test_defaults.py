"""SkyRL's defaults hold: a SkyRL-style command (a model path, no plugin key) composes, through SkyRL's own builder,
the config SkyRL's ``SkyRLTrainConfig()`` is, but for the deliberate exceptions listed here with their reasons; the
tiny demo (no model path) differs from SkyRL's defaults only where its own files say so."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.config.config import build_nested_dataclass

from skyrl_clora.config.help import conf_keys
from skyrl_clora.config.compose import CONF_DIR, compose_config
from skyrl_clora.backends.skyrl.config_translation import skyrl_tree
from skyrl_clora.config.skyrl_cli import preset_overrides

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


@pytest.mark.parametrize("overrides, added", [
    (["trainer.policy.model.path=/models/qwen"], True),
    (["trainer.policy.model.path=/models/qwen", "preset=demo"], False),
    (["trainer.policy.model.path=null"], False),
    (["+tenants=2"], False),
])
def test_a_model_path_picks_skyrls_preset_unless_one_is_chosen(overrides: list[str], added: bool) -> None:
    assert preset_overrides(overrides) == overrides + (["preset=skyrl"] if added else [])
