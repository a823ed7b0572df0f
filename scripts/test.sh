#!/usr/bin/env bash
# Run every test of the project: sets up what is missing (scripts/setup.sh), checks
# the patch series (build.py check), then runs pytest over tests/ (build manager,
# unit, upstream vLLM tests for the touched areas, two-instance integration tests).
#   scripts/test.sh [pytest args...]      e.g. scripts/test.sh -m "not integration"
# One line per set-up step; apt/pip/build/check output goes to a log named on the
# first line (.cache/logs/test-<time>.log); pytest's report comes to the terminal.
# -v / --verbose (also passed on to pytest) or VMP_VERBOSE=1 shows all of it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup.sh"   # the output functions only
for a in "$@"; do
  case "$a" in -v|--verbose) export VMP_VERBOSE=1 ;; esac
done
vmp_log_open test
"$ROOT/scripts/setup.sh"
cd "$ROOT"
PY="${VMP_VENV:-$ROOT/.venv}/bin/python"
vmp_run "python build.py check" "$PY" build.py check
vmp_run "ruff check (our code, ruff.toml)" "$PY" -m ruff check --quiet
vmp_run "ruff format --check (our code)" "$PY" -m ruff format --check --quiet
# vLLM's CPU backend needs tcmalloc (and Intel OpenMP) preloaded, in pytest's process too.
LD_PRELOAD="$("$PY" -c 'from harness.runtime_env import preload_libs; print(":".join(preload_libs()))')"
export LD_PRELOAD
vmp_say "pytest tests -ra --durations=15${*:+ $*}"
exec "$PY" -m pytest tests -ra --durations=15 "$@"
