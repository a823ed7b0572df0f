#!/usr/bin/env bash
# Run every test of the project: sets up what is missing (scripts/setup.sh), checks
# the patch series (build.py check), then runs pytest over tests/ (build manager,
# unit, upstream vLLM tests for the touched areas, two-instance integration tests).
#   scripts/test.sh [pytest args...]      e.g. scripts/test.sh -m "not integration"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
PY="${VMP_VENV:-$ROOT/.venv}/bin/python"
printf '\n[test %s] build.py check\n' "$(date +%H:%M:%S)"
"$PY" build.py check
# vLLM's CPU backend needs tcmalloc (and Intel OpenMP) preloaded, in pytest's process too.
LD_PRELOAD="$("$PY" -c 'from harness.runtime_env import preload_libs; print(":".join(preload_libs()))')"
export LD_PRELOAD
printf '\n[test %s] pytest\n' "$(date +%H:%M:%S)"
exec "$PY" -m pytest tests -ra --durations=15 "$@"
