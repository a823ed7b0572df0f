#!/usr/bin/env bash
# Run the tests of the project on every supported vLLM release: for each, set up
# what is missing (scripts/setup.sh --vllm V), check its patch series (build.py
# check), then run pytest (build manager, unit, upstream vLLM tests for the touched
# areas, two-instance integration tests).
#   scripts/test.sh [--vllm V] [pytest args...]      e.g. scripts/test.sh -m "not integration"
# Without --vllm: the rolls' set-up runs in the background beside the pinned release's
# (no test runs beside a set-up); then every release's tests but the integration tests
# run, all releases at once (one pytest each: they start no vLLM instance), then the
# integration tests, one release at a time. The pinned release (0.18.1) runs the
# whole suite, each roll (0.32.0) the whole suite but the patch manager's tests and
# the tests that do not depend on the release (harness.vllm_series: VMP_ONCE); of
# those, the ones that mostly wait run with the pinned release in the background
# beside every release's integration tests (VMP_BESIDE_INTEGRATION: the engine-only
# tests, a push source's answers, a blind fence's hold), and the pinned release's fault matrix and every release's
# bootstrap-port test beside the unit tests (VMP_BESIDE_UNIT: link cuts, deadlines,
# one instance's start; their reports come after). A roll that is checked only
# (0.33.0: no CPU build exists) gets `build.py check`.
# With --vllm V: the whole suite on release V alone, in one pytest. Exits non-zero
# if any run failed.
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
mkdir -p "$ROOT/.cache/logs"  # each pytest's report and each test's time

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

# prepare_release V: set release V up and check its series (ruff too, in one
# release's virtualenv); its interpreter goes to PY_OF[V]. Non-zero if a step failed.
declare -A PY_OF=()
prepare_release() {
  local version="$1" py vars
  vmp_say "=== vLLM $version ==="
  # errexit does not hold here (callers run this under ||): each step's status is checked.
  VMP_VLLM="$version" "$ROOT/scripts/setup.sh" || return
  vars="$(VMP_VLLM="$version" "${PYTHON:-python3}" -m harness.vllm_series shell)" || return
  eval "$vars"
  py="${VMP_VENV:-$VMP_DEFAULT_VENV}/bin/python"
  vmp_run "python build.py --patches $VMP_PATCHES check" "$py" build.py --patches "$VMP_PATCHES" check
  if [ "$version" = "$LINT_RELEASE" ]; then  # our code is the same for every release: once
    vmp_run "ruff check (our code, ruff.toml)" "$py" -m ruff check --quiet
    vmp_run "ruff format --check (our code)" "$py" -m ruff format --check --quiet
  fi
  PY_OF[$version]="$py"
}

# run_pytest V PART [pytest paths and args...]: pytest on release V (prepared);
# each test's time goes to .cache/logs/pytest-V[-PART].xml, for the slowest-first
# view of where CI's minutes go.
run_pytest() {
  local version="$1" part="$2" py="${PY_OF[$1]}" preload rc=0
  shift 2
  local times="$ROOT/.cache/logs/pytest-$version${part:+-$part}.xml"
  preload="$(preload_of "$py")"
  vmp_say "vLLM $version: pytest -ra --durations=15${*:+ $*} (each test's time: $times)"
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
  prepare_release "$only" || exit
  run_pytest "$only" "" tests "${args[@]}" || rc=$?
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
# prepare_release, which names the failed step.
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
ready=()  # the releases whose set-up and check passed, pinned first
if prepare_release "$VMP_PINNED"; then
  ready+=("$VMP_PINNED")
else
  failed+=("$VMP_PINNED")
fi
pinned_py="$(eval "$(VMP_VLLM="$VMP_PINNED" "${PYTHON:-python3}" -m harness.vllm_series shell)"
  echo "$VMP_DEFAULT_VENV/bin/python")"
# Rolls with no CPU build on the index: their series is checked, never run, with the
# pinned release's virtualenv (set up above; the check needs no vLLM).
for folder in $VMP_CHECKED_ONLY; do
  # its sdist is fetched here: no set-up of it runs that would (a fresh machine has none)
  # and verified against its neighbour: the deltas reviewed so far (releases.toml)
  ( vmp_run "python build.py --patches $folder fetch" "$pinned_py" build.py --patches "$folder" fetch
    vmp_run "python build.py --patches $folder check (not run on CPU)" \
      "$pinned_py" build.py --patches "$folder" check
    vmp_run "python build.py --patches $folder range-diff --expected" \
      "$pinned_py" build.py --patches "$folder" range-diff --expected ) || failed+=("$folder")
done
wait_roll_setups  # no test beside a set-up
for version in $VMP_ROLLS; do
  if prepare_release "$version"; then
    ready+=("$version")
  else
    failed+=("$version")
  fi
done

# What each release runs (harness/vllm_series.py): the pinned one the whole suite; a
# roll the whole suite but the tests that do not depend on the release (VMP_ONCE),
# which ran with the pinned one. Some run on their own, beside others (below).
# the pinned release's integration tests that run on their own, beside others
elsewhere=()
for path in ${VMP_BESIDE_INTEGRATION:-} ${VMP_BESIDE_UNIT:-}; do
  elsewhere+=("--ignore=$path")
done
once=()
for path in $VMP_ONCE; do
  once+=("--ignore=$path")
done
# beside_unit_of V: the integration tests release V runs beside the unit tests
# (VMP_BESIDE_UNIT; a roll those of them it runs: not the ones run once)
beside_unit_of() {
  local path
  for path in ${VMP_BESIDE_UNIT:-}; do
    if [ "$1" = "$VMP_PINNED" ] || [[ " $VMP_ONCE " != *" $path "* ]]; then
      printf '%s ' "$path"
    fi
  done
}
# paths_of V PART: release V's pytest paths and --ignore options of one part (unit:
# every test but the integration tests; integration: those)
paths_of() {
  local version="$1" part="$2"
  if [ "$part" = unit ] && [ "$version" = "$VMP_PINNED" ]; then
    echo tests --ignore=tests/integration "${elsewhere[@]}"
  elif [ "$part" = unit ]; then
    echo tests/unit tests/upstream "${once[@]}"
  elif [ "$version" = "$VMP_PINNED" ]; then
    echo tests/integration "${elsewhere[@]}"
  else
    local path beside=()
    for path in $(beside_unit_of "$version"); do
      beside+=("--ignore=$path")
    done
    echo tests/integration "${once[@]}" ${beside[@]+"${beside[@]}"}
  fi
}

# 1. Every release's tests but the integration tests, all releases at once, each
# pytest in its own process (one core each: they start no vLLM instance, and none of
# them measures time against a bound tighter than a loaded core keeps); beside them
# each release's integration tests that mostly wait (VMP_BESIDE_UNIT: one cluster
# each, whose deadlines are minutes, or one instance's start). Each one's report
# follows once all ended.
unit_pids=()
for version in ${ready[@]+"${ready[@]}"}; do
  log="$ROOT/.cache/logs/pytest-$version-unit.log"
  vmp_say "vLLM $version: the tests but the integration tests, beside the other releases' (output: $log)"
  # shellcheck disable=SC2046  # paths_of: paths and options, space-separated
  run_pytest "$version" unit $(paths_of "$version" unit) "${args[@]}" > "$log" 2>&1 &
  unit_pids+=("$version:unit:$!")
  beside="$(beside_unit_of "$version")"
  if [ -n "$beside" ]; then
    log="$ROOT/.cache/logs/pytest-$version-beside-unit.log"
    vmp_say "vLLM $version: ${beside% }, beside the tests but the integration tests (output: $log)"
    # shellcheck disable=SC2086  # beside: test paths, space-separated
    run_pytest "$version" beside-unit $beside "${args[@]}" > "$log" 2>&1 &
    unit_pids+=("$version:beside-unit:$!")
  fi
done
for entry in ${unit_pids[@]+"${unit_pids[@]}"}; do
  version="${entry%%:*}" part="${entry#*:}" rc=0
  part="${part%%:*}"
  wait "${entry##*:}" || rc=$?
  if [ "$part" = unit ]; then
    vmp_say "vLLM $version: the report of the tests but the integration tests:"
  else
    vmp_say "vLLM $version: the report of the integration tests beside them:"
  fi
  cat "$ROOT/.cache/logs/pytest-$version-$part.log"
  if [ "$rc" -ne 0 ]; then
    if [ "$part" = unit ]; then
      failed+=("$version (tests but integration)")
    else
      failed+=("$version (integration tests beside the unit tests)")
    fi
  fi
done

# 2. The integration tests (vLLM instances on both cores), one release at a time.
# The tests run once that mostly wait (VMP_BESIDE_INTEGRATION: the engine-only ones, no
# vLLM code, wait out link cuts and the kernel's retransmissions and a blind
# fence's hold; a push source's answers, D's hold) run with the pinned release's
# virtualenv, in the background beside every release's integration tests: they
# take longer than one release's (about 20 min against 10-12 on a 2-core host),
# and beside the rolls' alone they were CI's last 8 minutes.
beside_integration_pid=""
beside_integration_log="$ROOT/.cache/logs/pytest-beside-integration.log"
if [ -n "${VMP_BESIDE_INTEGRATION:-}" ] && [[ " ${ready[*]-} " == *" $VMP_PINNED "* ]]; then
  beside_integration_times="$ROOT/.cache/logs/pytest-beside-integration.xml"
  vmp_say "vLLM $VMP_PINNED: pytest -ra $VMP_BESIDE_INTEGRATION, in the background (its output: $beside_integration_log, each test's time: $beside_integration_times)"
  preload="$(preload_of "$pinned_py")"
  # shellcheck disable=SC2086  # VMP_BESIDE_INTEGRATION: test paths, space-separated
  VMP_VLLM="$VMP_PINNED" LD_PRELOAD="$preload" "$pinned_py" -m pytest -ra \
    --junitxml="$beside_integration_times" $VMP_BESIDE_INTEGRATION "${args[@]}" > "$beside_integration_log" 2>&1 &
  beside_integration_pid=$!
fi
for version in ${ready[@]+"${ready[@]}"}; do
  # shellcheck disable=SC2046  # paths_of: paths and options, space-separated
  run_pytest "$version" integration $(paths_of "$version" integration) "${args[@]}" \
    || failed+=("$version (integration)")
done
if [ -n "$beside_integration_pid" ]; then
  beside_integration_rc=0
  wait "$beside_integration_pid" || beside_integration_rc=$?
  vmp_say "vLLM $VMP_PINNED: the report of the tests beside the integration tests ($beside_integration_log):"
  cat "$beside_integration_log"
  if [ "$beside_integration_rc" -ne 0 ] && [ "$beside_integration_rc" -ne 5 ]; then  # 5: none selected (-m)
    failed+=("the tests beside the integration tests")
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then
  vmp_say "FAILED: ${failed[*]}"
  exit 1
fi
vmp_say "every supported release passed: $VMP_PINNED $VMP_ROLLS"
