#!/usr/bin/env bash
# The test suite: `bash scripts/test.sh` sets up the environment (first time only) and runs the CPU tests.
# Triton kernels run through the Triton interpreter on the CPU. Extra arguments go to pytest. `--fast` as the first
# argument runs the fast tier instead of every test: pytest -m "not e2e and not ray and not triton" (the markers are
# pyproject.toml's: no run of main, no Ray, no Triton kernel), on every core (pytest-xdist's -n auto).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$repo_root"
export TRITON_INTERPRET=1
set +e
tier=()
if [ "${1:-}" = "--fast" ]; then
    shift
    tier=(-m "not e2e and not ray and not triton" -n auto)
fi
python -m pytest -q -ra --durations=15 "${tier[@]}" "$@"
rc=$?
# pytest's exit code 5 means "no tests collected": a failure for us.
[ $rc -eq 5 ] && echo "error: pytest collected no tests" >&2
exit $rc
