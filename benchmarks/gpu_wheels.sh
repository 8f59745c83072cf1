#!/usr/bin/env bash
# Downloads the wheels of benchmarks/gpu_wheels.txt, for Python 3.12, into DIR (default
# .whl, which .gitignore keeps out of git), where benchmarks/gpu_check_device.sh installs
# them from on a machine with no network. Fails unless every one is pure Python.
#
#   benchmarks/gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "${dir}" \
  -r benchmarks/gpu_wheels.txt
for wheel in "${dir}"/*.whl; do
  [[ "${wheel}" == *-py3-none-any.whl ]] || { echo "not pure Python: ${wheel}" >&2; exit 1; }
done
ls "${dir}"
