#!/usr/bin/env bash
# benchmarks/gpu_check.py on a machine whose image holds JAX and the rest but not the
# wheels of benchmarks/gpu_wheels.txt, carried in WHEELS (default .whl; gpu_wheels.sh
# fetches them): installs them without an index or their requirements, then runs the
# check, its log and its JSON written to OUT (required). Extra flags go to the check.
#
#   OUT=/tmp/out benchmarks/gpu_check_device.sh [--budget_s=450]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the summary goes to}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/gpu_check_site "${WHEELS:-.whl}"/*.whl
export PYTHONPATH="/tmp/gpu_check_site:${PWD}${PYTHONPATH:+:${PYTHONPATH}}" PYTHONUNBUFFERED=1
mkdir -p "${OUT}"
# SIGINT past 9 minutes: the check then reports what ran, inside a 10-minute command.
timeout -s INT 540 python3 -m benchmarks.gpu_check --out="${OUT}" "$@" 2>&1 \
  | tee "${OUT}/gpu_check.log"
