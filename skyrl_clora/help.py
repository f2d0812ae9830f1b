"""``--help``: every settable key with its default and its one-line description, grouped as the config is.

The descriptions are the comments beside the keys in ``conf/`` (a key's comment, with the comment lines under
it that continue it), so the config files and the help cannot disagree. Sections: the base config's top-level
groups (``clora``, ``trainer``, ``data``, ``generator``, ``sampler``), then each option of each config group
(``recipe=gsm8k``, ``backend=skyrl``, ...; a ``_global_`` option's keys are written in full).
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


def help_text(conf_dir: Path) -> str:
    """The grouped key listing (see the module docstring)."""
    sections: list[tuple[str, list[KeyHelp]]] = []
    base = conf_keys(conf_dir / "config.yaml")
    for group in dict.fromkeys(key.path.split(".")[0] for key in base):
        sections.append((f"{group}.*", [k for k in base if k.path.split(".")[0] == group]))
    for folder in sorted(p for p in conf_dir.iterdir() if p.is_dir()):
        for option in sorted(folder.glob("*.yaml")):
            prefix = "" if is_global(option) else f"{folder.name}."
            keys = [KeyHelp(f"{prefix}{k.path}", k.default, k.description) for k in conf_keys(option)]
            sections.append((f"with {folder.name}={option.stem}", keys))
    lines = []
    for title, keys in sections:
        lines.append(f"{title}:")
        for key in keys:
            head = f"  {key.path}={key.default}"
            text = textwrap.fill(key.description, width=116, initial_indent=" " * 6, subsequent_indent=" " * 6)
            lines.append(head if not key.description else f"{head}\n{text}")
    return "\n".join(lines)
