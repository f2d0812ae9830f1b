"""The run's summary and reward plot (skyrl_clora.metrics), at the scale of many tenants."""

from __future__ import annotations

import io
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from matplotlib.colors import to_rgba
from tests.support.micro_task import micro_tenants, run_args

from skyrl_clora.main import main
from skyrl_clora.metrics import MetricsLog, reward_figure, write_run_summary
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
