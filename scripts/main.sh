#!/usr/bin/env bash
# The main job: set up what is missing (scripts/setup.sh), then run the transfer
# microbenchmark mb7 on the default model. Extra arguments go to mb7, e.g.
#   scripts/main.sh --sizes 1024,4096 --model /path/to/model
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "${VMP_VENV:-$ROOT/.venv}/bin/python" -m microbench.mb7 "$@"
