"""The build's package list covers the tree: every package folder under skyrl_clora/ and the top-level kernels/
(mapped to ``skyrl_clora.kernels``) are in pyproject's list, and the tree holds no symlink."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import skyrl_clora.kernels

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_build() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "skyrl_clora").rglob("__init__.py")}
    kernels = {
        ".".join(("skyrl_clora", *init.parent.relative_to(ROOT).parts)) for init in (ROOT / "kernels").rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == folders | kernels
    assert setuptools["package-dir"]["skyrl_clora.kernels"] == "kernels"
    assert Path(skyrl_clora.kernels.__file__).parent == ROOT / "kernels"


def test_the_tree_holds_no_symlink() -> None:
    listing = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert [line for line in listing.splitlines() if line.startswith("120000")] == []
