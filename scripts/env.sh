#!/usr/bin/env bash
# Sourced by scripts/run.sh and scripts/test.sh: makes (once) and activates a Python 3.12 venv with the
# project's dependencies, then installs this checkout into it in editable mode.
# The venv is cached outside the checkout, keyed on the dependency list, so a second run (or a fresh clone
# on the same machine) reuses it: ${SKYRL_CLORA_CACHE:-~/.cache/skyrl-clora}/venv-<hash>.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache_root=${SKYRL_CLORA_CACHE:-$HOME/.cache/skyrl-clora}
# The dependency list (project + test extras) read from pyproject.toml; the venv is keyed on it.
requirements=$(python3 - "$repo_root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
)
deps_hash=$(printf '%s\n' "$requirements" | sha256sum | cut -c1-12)
venv="$cache_root/venv-$deps_hash"

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3" \
                   "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12.1/bin/python3" python3.12; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  echo "error: Python 3.12 not found; install it (e.g. 'pyenv install 3.12.1') or set PYTHON312=/path/to/python3.12" >&2
  return 1
}

if [ ! -f "$venv/.complete" ]; then
  python312=$(find_python312)
  echo "[setup] creating $venv with $python312 (first run: downloads torch and SkyRL, a few minutes)" >&2
  rm -rf "$venv"; mkdir -p "$cache_root"
  "$python312" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" >&2 || true
  # Dependencies only (the project itself is installed editable below, from whichever checkout runs).
  printf '%s\n' "$requirements" > "$venv/requirements.txt"
  # On a terminal pip shows its download progress (a few GB the first time); elsewhere it stays quiet.
  if [ -t 2 ]; then
    "$venv/bin/python" -m pip install -r "$venv/requirements.txt" >&2 || true
  else
    "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt" 2>&1 | grep -v "is ignored" >&2 || true
  fi
  (cd / && "$venv/bin/python" -c "import torch, transformers, skyrl, skyrl_gym, ray, hydra, peft, pytest") \
    || { echo "error: dependency install failed; see pip output above" >&2; exit 1; }
  touch "$venv/.complete"
fi
editable_log=$(mktemp)
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo_root" >"$editable_log" 2>&1 \
  || { cat "$editable_log" >&2; echo "error: installing this checkout into $venv failed" >&2; exit 1; }
rm -f "$editable_log"
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
# One OpenMP thread per torch thread: the engine and trainer threads each take one of the two cores;
# more threads oversubscribe the cores and OpenMP spin-waits then make steps many times slower
# (RESULTS.md, Engine and trainer settings and why).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
