"""SkyRL's command line (:mod:`skyrl_clora.config.skyrl_cli`): SkyRL 0.4's own rewrites
(``SkyRLTrainConfig.from_cli_overrides``) hold here, so what SkyRL's entry point drops or renames is accepted with
its meaning and what it refuses is refused in one line; and a command naming a model path gets SkyRL's preset unless
it chooses one."""

from __future__ import annotations

from pathlib import Path

import pytest
from skyrl.train.config import SkyRLTrainConfig

from skyrl_clora.config.schema import ConfigError
from skyrl_clora.config.build import build_run_config
from skyrl_clora.config.keys import check_embedded_keys, given_keys
from skyrl_clora.config.compose import check_known_keys, compose_config
from skyrl_clora.main import main
from skyrl_clora.backends.skyrl.config_translation import translate
from skyrl_clora.config.skyrl_cli import preset_overrides, skyrl_cli_overrides

pytestmark = pytest.mark.usefixtures("without_production_extras")


@pytest.mark.parametrize("value", ["true", "True", "TRUE"])
def test_async_engine_true_is_dropped_as_skyrl_drops_it(value: str) -> None:
    override = f"generator.inference_engine.async_engine={value}"
    SkyRLTrainConfig.from_cli_overrides([override])  # SkyRL's entry point takes it
    assert skyrl_cli_overrides(["trainer.seed=3", override]) == ["trainer.seed=3"]


@pytest.mark.parametrize("override", [
    "generator.inference_engine.async_engine=false",
    "generator.inference_engine.async_engine=sometimes",
    "generator.inference_engine.enable_http_endpoint=true",
    "generator.inference_engine.override_existing_update_group=true",
    "generator.inference_engine.remote_urls=[127.0.0.1:8000]",
    "trainer.rope_theta=10000",
    "generator.inference_engine.engine_init_kwargs.hf_overrides.rope_scaling=2",
    "trainer.use_sample_packing=true trainer.remove_microbatch_padding=true",
])
def test_what_skyrl_refuses_is_refused_in_one_line(override: str) -> None:
    overrides = override.split()
    with pytest.raises(ValueError):
        SkyRLTrainConfig.from_cli_overrides(overrides)
    with pytest.raises(ConfigError) as caught:
        skyrl_cli_overrides(overrides)
    message = str(caught.value)
    assert "\n" not in message and overrides[0].split("=")[0].rsplit(".", 1)[-1] in message


@pytest.mark.parametrize("value", [False, True])
def test_use_sample_packing_is_renamed_as_skyrl_renames_it(value: bool) -> None:
    override = f"trainer.use_sample_packing={str(value).lower()}"
    with pytest.warns(DeprecationWarning):
        assert SkyRLTrainConfig.from_cli_overrides([override]).trainer.remove_microbatch_padding is value
    assert compose_config(skyrl_cli_overrides([override])).trainer.remove_microbatch_padding is value


def test_an_older_skyrl_scripts_lines_mean_what_skyrl_0_4_reads(tmp_path: Path) -> None:
    """``async_engine=true`` and ``trainer.strategy=fsdp2`` (run_gsm8k.sh before SkyRL dropped them) run: the first
    dropped, the second SkyRL's FSDP2 workers (``fsdp`` in SkyRL's config)."""
    args = skyrl_cli_overrides(["backend=skyrl", f"trainer.policy.model.path={tmp_path}", "trainer.strategy=fsdp2",
                                "generator.inference_engine.async_engine=true", f"clora.output_dir={tmp_path / 'o'}"])
    (tmp_path / "config.json").write_text("{}")
    cfg = compose_config(args)
    assert build_run_config(cfg).backend == "skyrl"
    assert translate(cfg, given=given_keys(args)).base.trainer.strategy == "fsdp"


def test_the_entry_point_refuses_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert main(["generator.inference_engine.async_engine=false", f"clora.output_dir={out}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: generator.inference_engine.async_engine=false: ")
    assert "remove the override" in errors[0] and not out.exists()


@pytest.mark.parametrize("override", [
    "generator.chat_template_kwargs.enable_thinking=false",
    "trainer.policy.model_config_kwargs.attn_implementation=eager",
    "generator.sampling_params.additional_kwargs.min_p=0.1",
    "+generator.inference_engine.engine_init_kwargs.enforce_eager=true",
])
def test_free_form_dict_keys_are_set_as_skyrls_command_line_sets_them(override: str, tmp_path: Path) -> None:
    """A key under SkyRL's free-form dicts needs no ``+`` (SkyRL parses with ``OmegaConf.from_cli``) and reaches
    SkyRL's translated config on backend=skyrl."""
    key, value = override.lstrip("+").split("=")
    expected = SkyRLTrainConfig.from_cli_overrides([override.lstrip("+")])
    args = skyrl_cli_overrides(["backend=skyrl", f"trainer.policy.model.path={tmp_path}", override])
    cfg = compose_config(args)
    check_known_keys(cfg, args)
    plan = translate(cfg, given=given_keys(args))
    parent, name = key.rsplit(".", 1)
    got, want = plan.base, expected
    for part in parent.split("."):
        got, want = getattr(got, part), getattr(want, part)
    assert got[name] == want[name] and str(got[name]).lower() == value


@pytest.mark.parametrize("override", [
    "trainer.policy.model_config_kwargs.attn_implementation=eager",
    "generator.sampling_params.additional_kwargs.min_p=0.1",
    "generator.eval_sampling_params.additional_kwargs.min_p=0.1",
])
def test_a_free_form_key_backend_embedded_cannot_honour_is_refused_in_one_line(override: str, tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    assert main([override, f"clora.output_dir={tmp_path}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and override.split("=")[0] in errors[0] and "backend=skyrl" in errors[0], errors


def test_chat_template_kwargs_reach_apply_chat_template_on_backend_embedded(micro_model_dir: Path, tmp_path: Path) -> None:
    """SkyRL's generator, as the embedded backend builds it, renders every prompt with the run's chat_template_kwargs:
    a template that reads ``enable_thinking`` renders differently with it."""
    from skyrl.train.config import SkyRLGymConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from transformers import AutoTokenizer

    from skyrl_clora.backends.embedded.backend import generator_config

    tokenizer = AutoTokenizer.from_pretrained(micro_model_dir)
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}nothink {% endif %}"
                               + tokenizer.chat_template)
    rendered = []
    for extra in ([], ["generator.chat_template_kwargs.enable_thinking=false"]):
        args = skyrl_cli_overrides([*extra, f"clora.output_dir={tmp_path}"])
        cfg = compose_config(args)
        check_known_keys(cfg, args)
        run = build_run_config(cfg)
        assert check_embedded_keys(cfg, extra) == []
        generator = SkyRLGymGenerator(generator_config(run, run.tenants[0]), SkyRLGymConfig(), None, tokenizer)
        rendered.append(tokenizer.decode(generator.base_conversation_token_ids))
    assert "nothink" not in rendered[0] and rendered[1].startswith("nothink") and rendered[1] != rendered[0]


def test_chat_template_kwargs_with_batched_generation_is_refused_as_skyrl_refuses_it(tmp_path: Path) -> None:
    args = skyrl_cli_overrides(["generator.chat_template_kwargs.enable_thinking=false", "generator.batched=true",
                                f"clora.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="needs generator.batched=false"):
        build_run_config(compose_config(args))


@pytest.mark.parametrize("overrides, added", [
    (["trainer.policy.model.path=/models/qwen"], True),
    (["trainer.policy.model.path=/models/qwen", "preset=demo"], False),
    (["trainer.policy.model.path=null"], False),
    (["+tenants=2"], False),
])
def test_a_model_path_picks_skyrls_preset_unless_one_is_chosen(overrides: list[str], added: bool) -> None:
    assert preset_overrides(overrides) == overrides + (["preset=skyrl"] if added else [])
