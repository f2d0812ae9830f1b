"""What running ``tinker-cookbook``'s own loops against the Tinker server takes on a machine without the Hugging
Face hub: the cookbook in an environment of its own, hub datasets it loads by name written into a local datasets
cache, and its recipes run as ``python -m tinker_cookbook.recipes.<name> key=value ...``.

The cookbook is 0.5.8, the newest whose dependencies the package registry here has (0.6 needs tml-renderers >= 0.4,
not there). It caps transformers at 5.5.4, below what SkyRL 0.4 and the server need, so it gets a venv of its own:
the current interpreter's packages (torch, tinker, datasets) stand behind the venv's own through a ``.pth`` line,
and pip installs only the cookbook and what it pins differently. The venv is cached under the project's cache
folder, keyed on the cookbook's version and the interpreter's site-packages.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skyrl_clora.tiny_base.pretrain import default_cache_root

COOKBOOK_REQUIREMENT = "tinker-cookbook[math-rl]==0.5.8"


def cookbook_python() -> Path:
    """The Python of a venv where ``tinker_cookbook`` imports (made on first use; about 20 s of pip).
    RuntimeError, with pip's output, when pip cannot install it."""
    site_packages = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(f"{COOKBOOK_REQUIREMENT}\n{site_packages}".encode()).hexdigest()[:12]
    venv = default_cache_root() / f"tinker-cookbook-venv-{key}"
    python, complete = venv / "bin" / "python", venv / ".complete"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete.is_file():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip()
        Path(own_site, "zz_host_site_packages.pth").write_text(site_packages + "\n")
        pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              COOKBOOK_REQUIREMENT], capture_output=True, text=True,
                          timeout=600)
        if pip.returncode != 0:
            raise RuntimeError(f"pip could not install {COOKBOOK_REQUIREMENT} into {venv}:\n{pip.stderr[-3000:]}")
        complete.touch()
    return python


def write_hub_dataset(cache: Path, repo_id: str, config_name: str, splits: dict[str, Sequence[dict[str, Any]]]
                      ) -> None:
    """Writes ``splits`` (split name -> rows) into the datasets cache folder ``cache`` as
    ``datasets.load_dataset(repo_id, config_name)`` finds it offline (``HF_HUB_OFFLINE=1``,
    ``HF_DATASETS_CACHE=cache``): ``<org>___<name>/<config_name>/0.0.0/local/``."""
    from datasets.packaged_modules.json.json import Json

    org, name = repo_id.split("/")
    sources = cache / f"sources-{org}-{name}"
    sources.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(sources / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    builder = Json(cache_dir=str(sources / "built"), dataset_name=name, config_name=config_name, data_files=files,
                   hash="local")
    builder.download_and_prepare()
    target = cache / f"{org}___{name}" / config_name / "0.0.0" / "local"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(builder.cache_dir, target)


def run_recipe(python: Path, recipe: str, cwd: Path, env: dict[str, str], **config: object
               ) -> subprocess.CompletedProcess[str]:
    """``python -m tinker_cookbook.recipes.<recipe> key=value ...`` in ``cwd`` with ``env`` added to this process's
    environment; its output captured. ``subprocess.TimeoutExpired`` past ten minutes (a hung loop)."""
    command = [str(python), "-m", f"tinker_cookbook.recipes.{recipe}", *(f"{k}={v}" for k, v in config.items())]
    return subprocess.run(command, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600)
