#!/usr/bin/env bash
# Downloads the wheels the GPU check needs (bench/gpu/wheels.txt) into .whl/ for a machine with
# Python and torch but no package index (the lent H200: Python 3.12, its own torch). check.sh
# installs them there with `pip install --no-index --no-deps --target`. Run it here, before the run:
#
#   bash bench/gpu/prepare.sh                       # cp312 manylinux x86_64 wheels (the H200)
#   bash bench/gpu/prepare.sh --python-version 3.11 # for this machine's Python (the offline test)
#   WHEELS=/tmp/w bash bench/gpu/prepare.sh         # another folder (default .whl, git-ignored)
#
# The run tool carries at most 64 MiB: the script fails when the folder holds more.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_VERSION=3.12
if [[ "${1:-}" == "--python-version" ]]; then PY_VERSION="$2"; shift 2; fi
WHEELS="${WHEELS:-.whl}"
PYTHON="${PYTHON:-python3}"
LIMIT_MIB=64
mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl  # a folder holds one Python version's wheels, never two
mapfile -t PINS < <(grep -vE '^\s*(#|$)' bench/gpu/wheels.txt)
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHEELS" "${PINS[@]}"
count=$(ls "$WHEELS"/*.whl | wc -l)
if [[ "$count" -ne "${#PINS[@]}" ]]; then
  echo "prepare.sh: ${#PINS[@]} pins but $count wheels in $WHEELS" >&2; exit 1
fi
mib=$(du -sm "$WHEELS" | cut -f1)
echo "prepare.sh: $count wheels for Python $PY_VERSION in $WHEELS, $mib MiB (limit $LIMIT_MIB)"
if [[ "$mib" -gt "$LIMIT_MIB" ]]; then echo "prepare.sh: over the $LIMIT_MIB MiB the run tool carries" >&2; exit 1; fi
