"""skyrl_clora.metrics: the run's summary and reward plot at the scale of many tenants, the status lines, and each
tenant's metrics reaching SkyRL's Tracking backends (TensorBoard read back with its own reader, wandb offline) beside
metrics.jsonl, with wandb refused before anything loads when it could not start."""

from __future__ import annotations

import io
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from matplotlib.colors import to_rgba
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tests.support.micro_task import micro_tenants, read_records, run_args

from skyrl_clora.main import main
from skyrl_clora.metrics import MetricsLog, check_trackers, reward_figure, write_run_summary
from skyrl_clora.tiny_base import pretrain


def _records(tenants: list[str], steps: int) -> list[dict]:
    records = []
    for index, tenant in enumerate(tenants):
        for step in range(1, steps + 1):
            records.append({"event": "step", "tenant": tenant, "step": step, "reward_mean": (index + step) % 10 / 10,
                            "rollout_s": 1.0, "train_s": 0.5, "sync_s": 0.1, "generated_tokens": 10})
    return records


def test_the_plot_of_32_tenants_gives_each_its_own_colour_a_legend_outside_and_whole_steps() -> None:
    tenants = [f"tenant-{i}" for i in range(32)]
    figure = reward_figure(_records(tenants, 3), tenants)
    axis = figure.axes[0]
    colours = [to_rgba(line.get_color()) for line in axis.lines]
    assert len(colours) == 32 and len(set(colours)) == 32
    figure.canvas.draw()
    legend = axis.get_legend().get_window_extent()
    assert legend.x0 >= axis.get_window_extent().x1  # beside the curves, not over them
    assert all(float(tick).is_integer() for tick in axis.get_xticks())


@dataclass(frozen=True)
class _Spec:
    name: str


def test_the_summary_gives_experiments_per_hour_with_and_without_the_base_models_build(tmp_path: Path) -> None:
    tenants = ["a", "b"]
    summary = write_run_summary(tmp_path, _records(tenants, 2), [_Spec(t) for t in tenants], {}, wall_s=3600.0,
                                base_model_s=3600.0, label="test")
    assert summary["experiments_per_hour"] == 2.0 and summary["experiments_per_hour_with_base_model"] == 1.0
    assert json.loads((tmp_path / "summary.json").read_text())["experiments_per_hour_with_base_model"] == 1.0


@pytest.mark.e2e
def test_the_summary_counts_the_base_models_build_when_this_command_built_it(
        tmp_path: Path, micro_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The tiny base is built before the run starts (main counts prompt tokens with its tokenizer), yet the
    summary reports that build: here a stand-in build that copies the micro model and takes at least
    ``build_s`` seconds."""
    build_s = 0.5
    built: list[Path] = []

    def build(cache_root: Path | None, recipe: pretrain.TinyBaseRecipe, force: bool = False) -> Path:
        final = pretrain.tiny_base_path(cache_root, recipe)
        if not final.is_dir():
            time.sleep(build_s)
            shutil.copytree(micro_model_dir, final)
            built.append(final)
        return final

    monkeypatch.setattr(pretrain, "ensure_tiny_base", build)
    monkeypatch.setenv("SKYRL_CLORA_CACHE", str(tmp_path / "cache"))
    args = [arg for arg in run_args(micro_model_dir, tmp_path / "out", micro_tenants({"name": "a"}), steps=1)
            if not arg.startswith("trainer.policy.model.path=")]
    assert main(args) == 0
    assert len(built) == 1
    seconds = json.loads((tmp_path / "out" / "summary.json").read_text())["base_model_seconds"]
    assert seconds >= build_s
    assert f"(+ base model {seconds:.1f}s)" in capsys.readouterr().out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_lines_update_in_place_on_a_terminal_and_follow_one_another_elsewhere(tmp_path: Path) -> None:
    records = sorted(_records(["a", "b"], 2), key=lambda record: record["step"])  # a1, b1, a2, b2
    for stream in (io.StringIO(), _Terminal()):
        log = MetricsLog(tmp_path / f"{type(stream).__name__}.jsonl", progress=True, stream=stream)
        for record in records:
            log.write(record)
        log.close()
        text = stream.getvalue()
        if stream.isatty():
            frames = text.split("\x1b[2F")  # each redraw moves up over the two tenants' lines
            assert len(frames) == 3 and "\x1b[2K" in text  # a2 and b2 redraw both lines
            last = frames[-1].replace("\x1b[2K", "").splitlines()
            assert [line.split("] ")[1].split()[0] for line in last] == ["a", "b"] and all("step 2" in line for line in last)
        else:
            assert "\x1b" not in text and len(text.splitlines()) == len(records)


@pytest.mark.e2e
def test_each_tenants_metrics_reach_tensorboard_and_wandb_offline(learning_model_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tenants = micro_tenants({"name": "a", "seed": 1}, {"name": "b", "seed": 2})
    assert main(run_args(learning_model_dir, tmp_path, tenants, "trainer.logger=[tensorboard,wandb,console]")) == 0
    records = read_records(tmp_path)
    for name in ("a", "b"):
        events = EventAccumulator(str(tmp_path / "tensorboard" / name))
        events.Reload()
        scalars = events.Tags()["scalars"]
        for tag in ("reward_mean", "train/policy_loss", "train/grad_norm", "rollout_s", "eval/accuracy",
                    "eval/all/avg_score", "eval/all/pass_at_1"):
            assert tag in scalars, (name, tag)
        steps = [r for r in records if r["tenant"] == name and r["event"] == "step"]
        logged = events.Scalars("reward_mean")
        assert [e.step for e in logged] == [r["step"] for r in steps]
        assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in steps], rel=1e-6)
        assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 3]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.e2e
def test_wandb_without_a_key_is_refused_before_anything_loads(micro_model_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """SkyRL's default logger is wandb: with no API key, no netrc entry and no offline mode, the run stops in one line
    naming the fixes (exit 2, nothing written), not after the model is loaded; offline mode or a key lets it through."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "run"
    args = run_args(micro_model_dir, out, micro_tenants({"name": "a", "seed": 1}), "trainer.logger=[wandb]")
    assert main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: trainer.logger includes wandb") and "WANDB_MODE=offline" in error
    assert not out.exists()  # nothing written, not even the folder
    from skyrl_clora.config.build import build_run_config
    from skyrl_clora.config.compose import compose_config

    run = build_run_config(compose_config(args))
    for variable, value in (("WANDB_MODE", "offline"), ("WANDB_API_KEY", "k" * 40)):
        with monkeypatch.context() as scoped:
            scoped.setenv(variable, value)
            check_trackers(run)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    monkeypatch.delenv("NETRC")
    check_trackers(run)

