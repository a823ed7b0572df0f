#!/usr/bin/env bash
# The main job: set up what is missing (scripts/setup.sh), then run the transfer
# microbenchmark mb7 on the default model. Extra arguments go to mb7, e.g.
#   scripts/main.sh --sizes 1024,4096 --model /path/to/model
#   VMP_VLLM=0.32.0 scripts/main.sh     on the roll onto vLLM 0.32.0 (docs/rolling.md)
# One line per set-up step; apt/pip/build output goes to a log named on the first
# line (.cache/logs/main-<time>.log); mb7 prints its progress and results, and
# names the files where the vLLM instances and the transfer engine log.
# -v / --verbose (taken out of mb7's arguments) or VMP_VERBOSE=1 shows all of it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup.sh"   # the output functions only
args=()
for a in "$@"; do
  case "$a" in
    -v|--verbose) export VMP_VERBOSE=1 ;;
    *) args+=("$a") ;;
  esac
done
vmp_log_open main
"$ROOT/scripts/setup.sh"
cd "$ROOT"
eval "$("${PYTHON:-python3}" -m harness.vllm_series shell)"   # VMP_VLLM=0.32.0: the roll
vmp_say "python -m microbench.mb7${args[*]:+ ${args[*]}} (vLLM $VMP_VLLM)"
exec "${VMP_VENV:-$VMP_DEFAULT_VENV}/bin/python" -m microbench.mb7 "${args[@]}"
