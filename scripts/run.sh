#!/usr/bin/env bash
# The main job: `bash scripts/run.sh +tenants=8` sets up the environment (first time only) and runs
# `python -m skyrl_clora.main` with the given Hydra overrides.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$repo_root"
exec python -m skyrl_clora.main "$@"
