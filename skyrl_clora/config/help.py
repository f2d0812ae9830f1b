"""``--help``: every settable key with its default and its one-line description, grouped as the config is.

The descriptions are the comments beside the keys in ``conf/`` (a key's comment, with the comment lines under
it that continue it), so the config files and the help cannot disagree. Sections: the base config's top-level
groups (``clora``, ``trainer``, ``data``, ``generator``, ``sampler``), then each option of each config group
(``recipe=gsm8k``, ``backend=skyrl``, ...; a ``_global_`` option's keys are written in full), then, per backend, the
SkyRL keys it accepts without acting on them and those it runs with one value only, each with why
(``config.keys``' rules: :func:`skyrl_key_rules_text`).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?P<value>[^#]*)(#\s?(?P<comment>.*))?$")
_CONTINUATION = re.compile(r"^ +#\s?(?P<comment>.*)$")


@dataclass(frozen=True)
class KeyHelp:
    """A key's dotted path under its section, its default as written, and its description."""

    path: str
    default: str
    description: str


def conf_keys(path: Path) -> list[KeyHelp]:
    """The keys of one conf file (mappings give a prefix, not a key), in file order."""
    keys: list[KeyHelp] = []
    parents: list[tuple[int, str]] = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        match = _KEY.match(line)
        if match is None:
            continue
        indent, key, value = len(match["indent"]), match["key"], match["value"].strip()
        parents = [(i, k) for i, k in parents if i < indent]
        comment = [match["comment"] or ""]
        for following in lines[number + 1:]:
            more = _CONTINUATION.match(following)
            if more is None or len(following) - len(following.lstrip()) <= indent:
                break
            comment.append(more["comment"])
        path_of_key = ".".join([k for _, k in parents] + [key])
        if value == "":  # a mapping: its keys follow, indented
            parents.append((indent, key))
            continue
        keys.append(KeyHelp(path_of_key, value, " ".join(part.strip() for part in comment if part.strip())))
    return keys


def is_global(path: Path) -> bool:
    """Whether conf file ``path`` is in Hydra's ``_global_`` package (its keys are absolute, not under its group)."""
    return path.read_text().startswith("# @package _global_")


def header(path: Path) -> str:
    """The comment lines that open conf file ``path`` (its ``@package`` line left out), as one text."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def help_text(conf_dir: Path) -> str:
    """The grouped key listing (see the module docstring); a group option's section opens with its file's header."""
    sections: list[tuple[str, str, list[KeyHelp]]] = []
    base = conf_keys(conf_dir / "config.yaml")
    for group in dict.fromkeys(key.path.split(".")[0] for key in base):
        sections.append((f"{group}.*", "", [k for k in base if k.path.split(".")[0] == group]))
    for folder in sorted(p for p in conf_dir.iterdir() if p.is_dir()):
        for option in sorted(folder.glob("*.yaml")):
            prefix = "" if is_global(option) else f"{folder.name}."
            keys = [KeyHelp(f"{prefix}{k.path}", k.default, k.description) for k in conf_keys(option)]
            sections.append((f"with {folder.name}={option.stem}", header(option), keys))
    lines = []
    for title, about, keys in sections:
        lines.append(f"{title}:")
        if about:
            lines.append(textwrap.fill(about, width=116, initial_indent="  ", subsequent_indent="  "))
        for key in keys:
            head = f"  {key.path}={key.default}"
            text = textwrap.fill(key.description, width=116, initial_indent=" " * 6, subsequent_indent=" " * 6)
            lines.append(head if not key.description else f"{head}\n{text}")
    return "\n".join([*lines, skyrl_key_rules_text()])


def skyrl_key_rules_text() -> str:
    """The SkyRL keys each backend ignores (accepted, acting on nothing: a line says so when one is given) and those
    it runs with one value only (another is refused in one line), each with its reason; docs/config.md has all."""
    from skyrl_clora.config.keys import IGNORED, KEY_RULES, REFUSED, SKYRL_RULES

    lines = []
    for title, action in (("ignored (given, a line says so)", IGNORED),
                          ("run with the value the backend implements only (else refused in one line)", REFUSED)):
        lines.append(f"SkyRL keys {title}:")
        for backend, rules in (("embedded", KEY_RULES), ("skyrl", SKYRL_RULES)):
            lines.append(f"  backend={backend}:")
            for rule in rules:
                if rule.action == action:
                    lines.append(textwrap.fill(f"{rule.key}: {rule.detail}", width=116, initial_indent=" " * 4,
                                               subsequent_indent=" " * 6))
    return "\n".join(lines)
