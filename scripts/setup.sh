#!/usr/bin/env bash
# Set up (or bring up to date) everything this project needs, on a fresh machine too:
# system libraries, the project virtualenv, torch, the Mooncake transfer engine,
# the patched vLLM tree (build.py apply) installed editable, with the precompiled
# kernels of the matching vLLM release wheel. Idempotent: steps that are already
# done are skipped.
#
#   scripts/setup.sh [--vllm 0.18.1|0.32.0] [--device auto|cpu|cuda] [-v|--verbose]
#   scripts/setup.sh --system-only      the system packages (apt) alone, for every release
#
# --vllm (or VMP_VLLM) picks the release: 0.18.1, the pinned series (patches/,
# third_party/vllm, .venv), is the default; 0.32.0 is its roll (rolls/0.32.0/,
# third_party/vllm-0.32.0, .venv-0.32.0, requirements/0.32.0/). Each release has its
# own virtualenv because each needs its own torch (harness/vllm_series.py).
#
# Prints one line per step (and how long it took); the output of apt, pip,
# build.py and the doctor goes to a log file named on the first line
# (.cache/logs/setup-<time>.log). -v, --verbose or VMP_VERBOSE=1 shows it on the
# terminal too. A failed step is named with the log's path and its last lines.
#
# The tree is installed with the documented line, in the activated virtualenv:
#   python build.py apply && pip install -e third_party/vllm
# which needs no environment of its own: apply records the device and the kernels'
# wheel in the tree (patchset/build_defaults.py; vLLM's setup.py reads them, patch
# 0011), and the virtualenv's pip.conf turns build isolation off. The virtualenv's
# bin/activate preloads tcmalloc (CPU), so `vllm serve` runs in it as well.
#
# Device "cuda" takes the precompiled CUDA kernels from the release's vllm wheel and
# the CUDA Mooncake engine; it is UNVERIFIED (no GPU on this project's machines).
#
# Sourced (`. scripts/setup.sh`, as main.sh and test.sh do), it only defines the
# output functions below and returns.
set -euo pipefail

# --- output: one line per step on the terminal, everything else in a log -------------
#
# vmp_log_open TAG   start logging for a script: TAG prefixes its lines; the log is
#                    $VMP_LOG when a calling script opened one already (and is not named
#                    again), else a new $VMP_LOG_DIR/TAG-<time>.log (default
#                    <project>/.cache/logs), named in one line. Exports VMP_LOG.
# vmp_run WHAT CMD.. runs CMD (a command or a shell function; with errexit in its
#                    subshell) with its output appended to the log (and shown with
#                    VMP_VERBOSE=1); prints "[TAG] WHAT ... 12s". On failure prints the
#                    step, the log's path and its last lines to stderr and exits with
#                    CMD's status.
# vmp_say TEXT       one line "[TAG] TEXT".

vmp_verbose() { case "${VMP_VERBOSE:-}" in ""|0) return 1 ;; *) return 0 ;; esac; }

vmp_say() { printf '[%s] %s\n' "$VMP_TAG" "$*"; }

vmp_duration() {  # seconds -> 9s, 2m41s, 1h02m
  local s=$1
  if [ "$s" -lt 60 ]; then printf '%ds' "$s"
  elif [ "$s" -lt 3600 ]; then printf '%dm%02ds' $((s / 60)) $((s % 60))
  else printf '%dh%02dm' $((s / 3600)) $((s % 3600 / 60)); fi
}

vmp_log_open() {
  VMP_TAG="$1"
  VMP_T0=$SECONDS
  if [ -n "${VMP_LOG:-}" ] && [ -f "$VMP_LOG" ]; then
    export VMP_LOG
    return 0
  fi
  local root dir
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  dir="${VMP_LOG_DIR:-$root/.cache/logs}"
  mkdir -p "$dir"
  VMP_LOG="$dir/$VMP_TAG-$(date +%Y%m%d-%H%M%S).log"
  [ -e "$VMP_LOG" ] && VMP_LOG="${VMP_LOG%.log}-$$.log"
  : > "$VMP_LOG"
  export VMP_LOG
  if vmp_verbose; then
    vmp_say "output below and in $VMP_LOG"
  else
    vmp_say "log: $VMP_LOG (-v shows it here)"
  fi
}

vmp_run() {
  local what="$1" t0=$SECONDS rc
  shift
  printf '\n# [%s %s] %s: %s\n' "$VMP_TAG" "$(date '+%F %T')" "$what" "$*" >> "$VMP_LOG"
  if vmp_verbose; then
    vmp_say "$what ..."
    set +e
    ( set -e; "$@" ) 2>&1 | tee -a "$VMP_LOG"
    rc=${PIPESTATUS[0]}
    set -e
  else
    printf '[%s] %s ... ' "$VMP_TAG" "$what"
    set +e
    ( set -e; "$@" ) >> "$VMP_LOG" 2>&1
    rc=$?
    set -e
  fi
  local took
  took=$(vmp_duration $((SECONDS - t0)))
  if [ "$rc" -ne 0 ]; then
    vmp_verbose && printf '[%s] %s ... ' "$VMP_TAG" "$what"
    printf 'FAILED after %s (exit %d)\n' "$took" "$rc"
    {
      printf '[%s] step failed: %s\n' "$VMP_TAG" "$what"
      printf '[%s] log: %s; its last lines:\n' "$VMP_TAG" "$VMP_LOG"
      tail -n 30 "$VMP_LOG" | sed 's/^/    /'
    } >&2
    exit "$rc"
  fi
  if vmp_verbose; then vmp_say "$what: done in $took"; else printf '%s\n' "$took"; fi
}

# Sourced: the functions above only.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE="${VMP_DEVICE:-auto}"
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) export VMP_VLLM="$2"; shift 2 ;;
    --vllm=*) export VMP_VLLM="${1#*=}"; shift ;;
    --device) DEVICE="$2"; shift 2 ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    -v|--verbose) export VMP_VERBOSE=1; shift ;;
    --system-only) SYSTEM_ONLY=1; shift ;;
    *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in auto|cpu|cuda) ;; *) echo "setup.sh: --device must be auto, cpu or cuda" >&2; exit 2 ;; esac

# The release: patch folder, tree, virtualenv, requirements (harness/vllm_series.py).
SERIES_VARS=$(cd "$ROOT" && "${PYTHON:-python3}" -m harness.vllm_series shell) || {
  echo "setup.sh: --vllm: see the supported releases above" >&2; exit 2; }
eval "$SERIES_VARS"
export VMP_VLLM

vmp_log_open setup
if [ -z "${SYSTEM_ONLY:-}" ]; then vmp_say "vLLM $VMP_VLLM: $VMP_PATCHES -> $VMP_TREE"; fi
VENV="${VMP_VENV:-$VMP_DEFAULT_VENV}"
PY="$VENV/bin/python"
export PIP_CONSTRAINT="$VMP_REQ_DIR/lock.txt"   # replaces any machine-wide constraint
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. System packages (Debian/Ubuntu).
APT_PKGS=(git curl libtcmalloc-minimal4 libibverbs1 libnuma1 quilt iproute2)
missing=()
for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
apt_install() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@"
}
if [ ${#missing[@]} -gt 0 ]; then
  vmp_run "apt: installing ${missing[*]}" apt_install "${missing[@]}"
else
  vmp_say "apt: ${#APT_PKGS[@]} system packages present"
fi
if [ -n "${SYSTEM_ONLY:-}" ]; then exit 0; fi

# 2. Virtualenv with the pinned Python packages.
if [ ! -x "$PY" ]; then
  vmp_run "creating virtualenv $VENV" "${PYTHON:-python3}" -m venv "$VENV"
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' || {
  echo "setup.sh: Python >= 3.11 required (set PYTHON=...)" >&2; exit 2; }
# The device, decided as build.py apply decides it (auto: cuda when nvidia-smi lists a GPU);
# apply below gets the same request.
export VMP_DEVICE="$DEVICE"
DEVICE=$(cd "$ROOT" && "$PY" -m patchset.build_defaults device)
REQ="$VMP_REQ_DIR/$DEVICE.txt"
REQ_NAME="${REQ#"$ROOT/"}"
REQ_STAMP="$VENV/.vmp-req-$DEVICE"
req_hash=$(cat "$REQ" "$VMP_REQ_DIR/base.txt" "$ROOT/requirements/tools.txt" "$PIP_CONSTRAINT" \
  | sha256sum | cut -c1-16)
pip_install_requirements() {
  # Build isolation on for these, whatever $VENV/pip.conf says (an sdist among them
  # needs its own build dependencies). pip reads this variable inverted: "true"
  # means isolation on.
  PIP_NO_BUILD_ISOLATION=true "$PY" -m pip install --progress-bar off -q "pip==25.3"
  PIP_NO_BUILD_ISOLATION=true "$PY" -m pip install --progress-bar off -r "$REQ"
  echo "$req_hash" > "$REQ_STAMP"
}
if [ "$(cat "$REQ_STAMP" 2>/dev/null)" != "$req_hash" ]; then
  # torch is large: a first install takes a few minutes
  vmp_run "pip: installing $REQ_NAME" pip_install_requirements
else
  vmp_say "pip: $REQ_NAME installed ($VENV)"
fi

# 2b. How pip installs into this virtualenv ($VENV/pip.conf, pip's "site" config,
# rewritten on every run): the lock for every install, and no build isolation, so
# `pip install -e third_party/vllm` builds against this virtualenv's torch instead
# of downloading torch (CUDA, GBs) into an isolated build env. pip inverts
# store_false options read from config: "no-build-isolation = false" is what
# means --no-build-isolation (checked with pip 25.3).
cat > "$VENV/pip.conf" <<EOF
# Written by scripts/setup.sh.
[global]
constraint = $PIP_CONSTRAINT

[install]
# pip reads this inverted: false = --no-build-isolation
no-build-isolation = false
EOF

# 3-4. The patched vLLM tree, installed editable with the documented line, as a
# user runs it in the activated virtualenv: apply records the device and the
# kernels' wheel (downloaded once into the cache, sha256-verified) in the tree;
# the install is skipped when this tree, defaults and lock are installed already.
# The pinned release uses exactly the documented line; a roll names its folder.
set +u; . "$VENV/bin/activate"; set -u
cd "$ROOT"
if [ "$VMP_PATCHES" = patches ]; then
  vmp_run "python build.py apply" python build.py apply
else
  vmp_run "python build.py --patches $VMP_PATCHES apply" python build.py --patches "$VMP_PATCHES" apply
fi
TREE="$ROOT/$VMP_TREE"
tree_hash=$(cat "$VMP_PATCHES"/series "$VMP_PATCHES"/*.patch "$PIP_CONSTRAINT" \
  "$TREE/.vmp-build-defaults.json" | sha256sum | cut -c1-16)
INSTALL_STAMP="$VENV/.vmp-vllm-$DEVICE"
installed_at=$(python - <<'PYEOF' 2>/dev/null || true
import importlib.util, os
spec = importlib.util.find_spec("vllm")
print(os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else "")
PYEOF
)
pip_install_tree() {
  pip install -e "$VMP_TREE"
  echo "$tree_hash" > "$INSTALL_STAMP"
}
if [ "$installed_at" != "$TREE" ] || [ "$(cat "$INSTALL_STAMP" 2>/dev/null)" != "$tree_hash" ]; then
  # precompiled kernels, see $VMP_TREE/.vmp-build-defaults.json
  vmp_run "pip install -e $VMP_TREE" pip_install_tree
else
  vmp_say "pip install -e $VMP_TREE: this tree is installed"
fi
# 4b. The tree's bytecode. pip compiles a wheel's modules at install, never an
# editable tree's: Python writes them at first import, unless PYTHONDONTWRITEBYTECODE
# is set (as on this project's CI machines), when every process of every instance
# compiles vLLM's modules again (API server, engine core and, on 0.32.0's CPU
# backend, a worker: 9-16 s of a two-instance start measured on 2 cores).
# Up-to-date modules are skipped (their source's time and size are checked).
vmp_run "compiling $VMP_TREE/vllm's bytecode (python -m compileall)" \
  python -m compileall -q -j 0 "$VMP_TREE/vllm"

# 5. vLLM's CPU backend refuses to start unless tcmalloc (and, since Intel OpenMP is
# installed, libiomp5) is in LD_PRELOAD. The virtualenv's bin/activate preloads
# what the harness preloads (harness/runtime_env.py preload_libs), so `vllm serve`
# works in the activated virtualenv. After the install: vLLM's requirements bring
# Intel OpenMP. The block between the markers is rewritten on every run.
ACTIVATE="$VENV/bin/activate"
MARK_BEGIN="# >>> vllm-mooncake-patches: LD_PRELOAD for vLLM's CPU backend (scripts/setup.sh) >>>"
MARK_END="# <<< vllm-mooncake-patches <<<"
sed -i "\\|^$MARK_BEGIN\$|,\\|^$MARK_END\$|d" "$ACTIVATE"
if [ "$DEVICE" = cpu ]; then
  PRELOAD=$(cd "$ROOT" && "$PY" -c 'from harness.runtime_env import preload_libs; print(" ".join(preload_libs()))')
  cat >> "$ACTIVATE" <<EOF
$MARK_BEGIN
for _vmp_lib in $PRELOAD; do
  case ":\${LD_PRELOAD-}:" in *":\$_vmp_lib:"*) ;; *) LD_PRELOAD="\${LD_PRELOAD:+\$LD_PRELOAD:}\$_vmp_lib" ;; esac
done
unset _vmp_lib
export LD_PRELOAD
$MARK_END
EOF
fi

# 6. Smoke check: the installed vLLM is this tree and release, kernels and engine load.
vmp_run "checking the installation (python -m harness.doctor)" python -m harness.doctor
vmp_say "ready ($DEVICE, $VENV) in $(vmp_duration $((SECONDS - VMP_T0)))"
