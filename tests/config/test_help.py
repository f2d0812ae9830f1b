"""``--help`` (:mod:`skyrl_clora.config.help`): every key of every conf file is listed with its default and its
description (the conf files' comments), each group option's section opens with its file's header, the SkyRL keys
each backend ignores or runs with one value only are listed with their reasons; and the conf-file reading itself
(keys under their mappings, comments continued on the lines below, ``_global_`` files, headers) on small files."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_clora.config.help import KeyHelp, conf_keys, header, help_text, is_global
from skyrl_clora.main import main


def test_help_describes_every_key_of_every_group(capsys: pytest.CaptureFixture) -> None:
    """Every key of every conf file (backend=skyrl's and tau-bench's too) is listed with its default and a
    description; the descriptions are the conf files' comments."""
    from skyrl_clora.config.help import conf_keys
    from skyrl_clora.config.compose import CONF_DIR

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for needle in ("+tenants=N", "recipe=gsm8k|skyrl|skyrl_gsm8k|taubench", "preset=demo|skyrl", "with recipe=taubench:", "with backend=skyrl:"):
        assert needle in text
    lines = text.splitlines()
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        group = path.parent.name
        prefix = "" if path.parent == CONF_DIR or is_global(path) else f"{group}."
        section = 0 if path.parent == CONF_DIR else lines.index(f"with {group}={path.stem}:")
        for key in conf_keys(path):
            assert key.description, f"{path.name}: {key.path} has no comment to describe it"
            head = f"  {prefix}{key.path}={key.default}"
            assert head in lines[section:], head
            at = lines.index(head, section)
            assert lines[at + 1].strip().startswith(key.description.split()[0]), head


def test_help_opens_each_group_options_section_with_its_files_header(capsys: pytest.CaptureFixture) -> None:
    from skyrl_clora.config.help import header
    from skyrl_clora.config.compose import CONF_DIR

    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for path in sorted(CONF_DIR.glob("*/*.yaml")):
        about = header(path)
        assert about, f"{path} has no header comment to describe it"
        start = lines.index(f"with {path.parent.name}={path.stem}:") + 1
        assert " ".join(line.strip() for line in lines[start:start + 8]).startswith(about[:60]), path


def test_help_lists_each_skyrl_key_a_backend_ignores_or_runs_with_one_value_only(capsys: pytest.CaptureFixture) -> None:
    """Every ignored or one-value rule of both backends is in --help, under its backend, with its reason."""
    from skyrl_clora.config.keys import HONOURED, KEY_RULES, SKYRL_RULES

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for backend, rules in (("embedded", KEY_RULES), ("skyrl", SKYRL_RULES)):
        listed = [rule for rule in rules if rule.action != HONOURED]
        assert listed
        for rule in listed:
            start = text.index(f"backend={backend}: ", text.index(f"SkyRL keys {'ignored' if rule.action == 'ignored' else 'run with'}"))
            assert f"{rule.key}: {' '.join(rule.detail.split())}" in text[start:], rule.key


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_conf_files_keys_are_read_with_their_paths_defaults_and_comments(tmp_path: Path) -> None:
    path = _write(tmp_path, "config.yaml", "# The header.\n"
                  "top: 3  # the top key\n"
                  "group:\n"
                  "  inner: abc  # an inner key,\n"
                  "    # continued below\n"
                  "  deeper:\n"
                  "    leaf: null\n"
                  "  # a comment of the mapping, not of leaf\n"
                  "after: [1, 2]  # back at the top\n")
    assert conf_keys(path) == [KeyHelp("top", "3", "the top key"),
                               KeyHelp("group.inner", "abc", "an inner key, continued below"),
                               KeyHelp("group.deeper.leaf", "null", ""),
                               KeyHelp("after", "[1, 2]", "back at the top")]
    assert header(path) == "The header."
    assert not is_global(path)


def test_a_group_options_section_opens_with_its_header_and_writes_global_keys_in_full(tmp_path: Path) -> None:
    _write(tmp_path, "config.yaml", "clora:\n  mode: serial  # how tenants run\n")
    _write(tmp_path, "recipe/toy.yaml", "# A toy recipe\n# over two lines.\nsteps: 2  # its steps\n")
    path = _write(tmp_path, "preset/fast.yaml", "# @package _global_\n# Fast settings.\ntrainer:\n  epochs: 1  # one\n")
    assert is_global(path) and header(path) == "Fast settings."
    lines = help_text(tmp_path).splitlines()
    at = lines.index("with preset=fast:")
    assert lines[at + 1:at + 4] == ["  Fast settings.", "  trainer.epochs=1", "      one"]
    at = lines.index("with recipe=toy:")
    assert lines[at + 1:at + 4] == ["  A toy recipe over two lines.", "  recipe.steps=2", "      its steps"]
    assert lines[:3] == ["clora.*:", "  clora.mode=serial", "      how tenants run"]
