#!/usr/bin/env bash
# Run the tests of the project on every supported vLLM release: for each, set up
# what is missing (scripts/setup.sh --vllm V), check its patch series (build.py
# check), then run pytest (build manager, unit, upstream vLLM tests for the touched
# areas, two-instance integration tests).
#   scripts/test.sh [--vllm V] [pytest args...]      e.g. scripts/test.sh -m "not integration"
# Without --vllm: the rolls' set-up runs in the background beside the pinned release's
# (no test runs beside a set-up); the pinned release (0.18.1) runs the whole suite, then each roll
# (0.32.0) the whole suite but the patch manager's tests and the engine-only tests
# (harness.vllm_series.RELEASE_INDEPENDENT_TESTS), which do not depend on the
# release and run once, with the pinned release, in the background beside the rolls'
# set-up and tests (they mostly wait; their report comes at the end); a roll that is
# checked only (0.33.0: no CPU build exists) gets `build.py check`. With --vllm V: the whole suite on release V alone. Exits
# non-zero if any run failed.
# One line per set-up step; apt/pip/build/check output goes to a log named on the
# first line (.cache/logs/test-<time>.log); pytest's report comes to the terminal.
# -v / --verbose (also passed on to pytest) or VMP_VERBOSE=1 shows all of it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup.sh"   # the output functions only

only=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) only="$2"; shift 2 ;;
    --vllm=*) only="${1#*=}"; shift ;;
    -v|--verbose) export VMP_VERBOSE=1; args+=("$1"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
vmp_log_open test
cd "$ROOT"

# preload_of PYTHON: the libraries vLLM's CPU backend needs preloaded (tcmalloc, and
# Intel OpenMP), in pytest's process too, for that virtualenv's interpreter.
preload_of() {
  "$1" -c 'from harness.runtime_env import preload_libs; print(":".join(preload_libs()))'
}

# Roll set-ups started in the background (version:pid), and the wait for them
# before any test (run_release).
roll_setups=()
wait_roll_setups() {
  local entry version pid rc
  for entry in ${roll_setups[@]+"${roll_setups[@]}"}; do
    version="${entry%%:*}" pid="${entry#*:}" rc=0
    wait "$pid" || rc=$?
    vmp_say "vLLM $version: set-up in the background $([ "$rc" -eq 0 ] && echo ended || echo "FAILED (exit $rc): run again before its tests"):"
    sed 's/^/    /' "$(dirname "$VMP_LOG")/setup-$version-background.out"
  done
  roll_setups=()
}

# run_release V [pytest paths and args...]: set up release V, check its series, pytest.
run_release() {
  local version="$1" py
  shift
  vmp_say "=== vLLM $version ==="
  # errexit does not hold here (callers run this under ||): each step's status is checked.
  VMP_VLLM="$version" "$ROOT/scripts/setup.sh" || return
  local vars
  vars="$(VMP_VLLM="$version" "${PYTHON:-python3}" -m harness.vllm_series shell)" || return
  eval "$vars"
  py="${VMP_VENV:-$VMP_DEFAULT_VENV}/bin/python"
  vmp_run "python build.py --patches $VMP_PATCHES check" "$py" build.py --patches "$VMP_PATCHES" check
  if [ "$version" = "$LINT_RELEASE" ]; then  # our code is the same for every release: once
    vmp_run "ruff check (our code, ruff.toml)" "$py" -m ruff check --quiet
    vmp_run "ruff format --check (our code)" "$py" -m ruff format --check --quiet
  fi
  wait_roll_setups  # no test beside a set-up
  local preload
  preload="$(preload_of "$py")"
  # every test's time, for the slowest-first view of where CI's minutes go
  local times="$ROOT/.cache/logs/pytest-$version.xml"
  vmp_say "vLLM $version: pytest -ra --durations=15${*:+ $*} (each test's time: $times)"
  local rc=0
  VMP_VLLM="$version" LD_PRELOAD="$preload" "$py" -m pytest -ra --durations=15 \
    --junitxml="$times" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then  # pytest: no test selected (e.g. by -m) in this release
    vmp_say "vLLM $version: no test selected"
    rc=0
  fi
  return "$rc"
}

# VMP_PINNED, VMP_ROLLS, VMP_CHECKED_ONLY (patch folders), VMP_ONCE (test paths)
releases="$("${PYTHON:-python3}" -m harness.vllm_series releases)"
eval "$releases"
LINT_RELEASE="${only:-$VMP_PINNED}"  # ruff runs once, in this release's virtualenv

if [ -n "$only" ]; then
  rc=0
  run_release "$only" tests "${args[@]}" || rc=$?
  exit "$rc"
fi

# Every release in its own virtualenv: VMP_VENV names one, so it goes with --vllm only.
unset VMP_VENV
failed=()
# The rolls' set-up (their virtualenv, pip and tree: mostly downloads and one core's
# installs) runs in the background beside the pinned release's set-up, after the
# system packages, which every release shares (apt takes one process at a time). No
# test starts before every set-up has ended (wait_roll_setups): the tests keep both
# cores. A failed background set-up is run again, in the foreground, by its release's
# run_release, which names the failed step.
printf '[%s] system packages (scripts/setup.sh --system-only) ... ' "$VMP_TAG"
if "$ROOT/scripts/setup.sh" --system-only >> "$VMP_LOG" 2>&1; then
  echo done
else  # each release's set-up runs it again and names what failed
  echo "FAILED (log: $VMP_LOG)"
fi
for version in $VMP_ROLLS; do
  VMP_LOG="" VMP_VLLM="$version" "$ROOT/scripts/setup.sh" \
    > "$(dirname "$VMP_LOG")/setup-$version-background.out" 2>&1 &
  roll_setups+=("$version:$!")
done
# The engine-only tests (no vLLM code; they mostly wait out link cuts and the kernel's
# retransmissions) run with the pinned release's virtualenv, beside the rolls' set-up
# and tests instead of before them: CI's time.
engine_only=()
for path in ${VMP_ENGINE_ONLY:-}; do
  engine_only+=("--ignore=$path")
done
run_release "$VMP_PINNED" tests "${engine_only[@]}" "${args[@]}" || failed+=("$VMP_PINNED")
pinned_py="$(eval "$(VMP_VLLM="$VMP_PINNED" "${PYTHON:-python3}" -m harness.vllm_series shell)"
  echo "$VMP_DEFAULT_VENV/bin/python")"
engine_pid=""
engine_log="$ROOT/.cache/logs/pytest-engine-only.log"
if [ ${#engine_only[@]} -gt 0 ]; then
  engine_times="$ROOT/.cache/logs/pytest-engine-only.xml"
  vmp_say "vLLM $VMP_PINNED: pytest -ra $VMP_ENGINE_ONLY, in the background (its output: $engine_log, each test's time: $engine_times)"
  preload="$(preload_of "$pinned_py")"
  # shellcheck disable=SC2086  # VMP_ENGINE_ONLY: test paths, space-separated
  VMP_VLLM="$VMP_PINNED" LD_PRELOAD="$preload" "$pinned_py" -m pytest -ra \
    --junitxml="$engine_times" $VMP_ENGINE_ONLY "${args[@]}" > "$engine_log" 2>&1 &
  engine_pid=$!
fi
# Rolls with no CPU build on the index: their series is checked, never run, with the
# pinned release's virtualenv (set up above; the check needs no vLLM).
for folder in $VMP_CHECKED_ONLY; do
  # its sdist is fetched here: no set-up of it runs that would (a fresh machine has none)
  ( vmp_run "python build.py --patches $folder fetch" "$pinned_py" build.py --patches "$folder" fetch
    vmp_run "python build.py --patches $folder check (not run on CPU)" \
      "$pinned_py" build.py --patches "$folder" check ) || failed+=("$folder")
done
# Tests that do not depend on the release ran with the pinned one (harness/vllm_series.py).
once=()
for path in $VMP_ONCE; do
  once+=("--ignore=$path")
done
for version in $VMP_ROLLS; do
  run_release "$version" tests/unit tests/upstream tests/integration "${once[@]}" "${args[@]}" \
    || failed+=("$version")
done
if [ -n "$engine_pid" ]; then
  engine_rc=0
  wait "$engine_pid" || engine_rc=$?
  vmp_say "vLLM $VMP_PINNED: the engine-only tests' report ($engine_log):"
  cat "$engine_log"
  if [ "$engine_rc" -ne 0 ] && [ "$engine_rc" -ne 5 ]; then  # 5: none selected (-m)
    failed+=("engine-only tests")
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then
  vmp_say "FAILED: ${failed[*]}"
  exit 1
fi
vmp_say "every supported release passed: $VMP_PINNED $VMP_ROLLS"
