"""What a run's configuration needs of the world around it (:mod:`skyrl_clora.config.checks`): the files and
folders it reads (one problem line each, all at once), ``trainer.algorithm`` as SkyRL's ``AlgorithmConfig`` and
registries take it with the KL options and loss reductions the plugin honours, and an output folder that can be
made, checked without leaving anything behind."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from skyrl.train.config import KLCtrlConfig

from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.checks import algorithm_config, check_algorithm, check_inputs, check_output_dir
from skyrl_clora.config.compose import compose_config
from skyrl_clora.config.schema import ConfigError


def test_every_missing_input_is_one_problem_line(tmp_path: Path) -> None:
    run = build_run_config(compose_config([f"clora.output_dir={tmp_path / 'out'}"]))
    assert check_inputs(run) == [], "the demo reads the recipe corpus only"
    (tmp_path / "model").mkdir()
    broken = dataclasses.replace(
        run, recipe=dataclasses.replace(run.recipe, train_data=(str(tmp_path / "train.parquet"),),
                                        val_data=(str(tmp_path / "val.parquet"),)),
        trainer=dataclasses.replace(run.trainer, resume_mode="from_path", resume_path=str(tmp_path / "earlier")),
        model_path=str(tmp_path / "model"))
    assert check_inputs(broken) == [
        f"data.train_data: {tmp_path}/train.parquet does not exist; point it at an existing file",
        f"data.val_data: {tmp_path}/val.parquet does not exist; point it at an existing file",
        f"trainer.resume_path={tmp_path}/earlier is not a folder; point it at an earlier run's trainer.ckpt_path",
        f"trainer.policy.model.path={tmp_path}/model is not a Hugging Face model folder (no config.json); fix the path",
    ]
    (tmp_path / "model" / "config.json").write_text("{}")
    assert len(check_inputs(broken)) == 3
    no_corpus = check_inputs(dataclasses.replace(run, model_corpus="taubench"))
    assert len(no_corpus) == 1 and no_corpus[0].startswith("model.corpus=taubench is no recipe with a pre-training corpus")


def test_the_algorithm_is_skyrls_dataclass_with_its_nested_configs() -> None:
    config = algorithm_config({"advantage_estimator": "rloo", "kl_ctrl": {"type": "adaptive", "horizon": 8}})
    assert config.advantage_estimator == "rloo" and isinstance(config.kl_ctrl, KLCtrlConfig)
    assert (config.kl_ctrl.type, config.kl_ctrl.horizon) == ("adaptive", 8)
    check_algorithm({"advantage_estimator": "rloo", "use_kl_in_reward": True, "use_kl_loss": False,
                     "kl_estimator_type": "abs", "kl_ctrl": {"type": "adaptive", "horizon": 8}})


@pytest.mark.parametrize("algorithm, message", [
    ({"nope": 1}, r"^trainer.algorithm: Invalid fields \{'nope'\} for AlgorithmConfig"),
    ({"eps_clip_low": "abc"}, r"^trainer.algorithm.eps_clip_low=abc must be a number$"),
    ({"use_kl_loss": "maybe"}, r"^trainer.algorithm.use_kl_loss=maybe must be true or false$"),
    ({"kl_estimator_type": "k9"}, r"^trainer.algorithm.kl_estimator_type=k9 is unknown; use one of k1, k2, k3, abs$"),
    ({"use_kl_in_reward": True, "use_kl_loss": True}, r"^trainer.algorithm.use_kl_in_reward and use_kl_loss are "
                                                      r"mutually exclusive"),
    ({"use_kl_in_reward": True, "use_kl_loss": False, "kl_ctrl": {"type": "weird"}},
     r"^trainer.algorithm.kl_ctrl: Invalid KL controller type: weird; fix kl_ctrl.type"),
    ({"loss_reduction": "bogus"}, r"^trainer.algorithm.loss_reduction=bogus is unknown; use one of token_mean"),
    ({"advantage_estimator": "nope"}, r"^trainer.algorithm.advantage_estimator=nope is not in SkyRL's registry; use "
                                      r"one of .*\bgrpo\b"),
    ({"policy_loss_type": "nope"}, r"^trainer.algorithm.policy_loss_type=nope is not in SkyRL's registry; use one "
                                   r"of .*\bregular\b"),
])
def test_a_bad_algorithm_setting_is_one_line(algorithm: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        check_algorithm(algorithm)
    assert "\n" not in str(error.value)


def test_the_output_dir_check_leaves_nothing_behind(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "a" / "b" / "c")
    assert list(tmp_path.iterdir()) == [], "the folders made to find out are removed"
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "file").write_text("x")
    check_output_dir(tmp_path / "kept")
    assert (tmp_path / "kept" / "file").read_text() == "x"
    with pytest.raises(ConfigError, match=r"^clora.output_dir=/proc/forbidden/x is not writable"):
        check_output_dir(Path("/proc/forbidden/x"))
