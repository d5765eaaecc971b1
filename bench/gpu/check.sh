#!/usr/bin/env bash
# The GPU check (bench/gpu/check.py): LLaDA-8B-shaped rollouts and LoRA / full fine-tuning steps on one
# GPU, at most 8 minutes, report.json + report.md in the output directory ($OUT on the device machine).
#
#   bash bench/gpu/prepare.sh               # here, once: the wheels into .whl/ (the run tool carries it)
#   bash bench/gpu/check.sh                 # one H200: the full check (writes $OUT, else runs/gpu_check)
#   bash bench/gpu/check.sh --tiny          # the same code paths on the CPU in seconds (make test runs it)
#   bash bench/gpu/check.sh --only rollout  # one section (matmul always runs: MFU needs its peak)
#
# PYTHON picks the interpreter (default: .venv/bin/python when present, else python3, the one that
# holds PyTorch on the device machine). When .whl/ (or $WHEELS) holds wheels, they are installed with
# `pip install --no-index --no-deps --target $SITE` (default /tmp/ddrl-site) and put first on
# PYTHONPATH: the machine's own torch is used, everything else is ddrl's pins. The script stops before
# the check when torch is older than MIN_TORCH (README.md says why that version).
# CHECK_TIMEOUT_S (default 480) is the hard limit: the script is interrupted then, and every section
# finished before it is already in the report.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MIN_TORCH=2.6
WHEELS="${WHEELS:-.whl}"
SITE="${SITE:-/tmp/ddrl-site}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TAG=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
OTHER=$(ls "$WHEELS"/*.whl 2>/dev/null | grep -E -- '-cp3[0-9]+-cp3[0-9]+-' | grep -v -- "-$TAG-$TAG-" || true)
if [[ -n "$OTHER" ]]; then  # say, the cp312 wheels for the H200 in a checkout on a Python 3.11 machine
  echo "[check] $WHEELS holds wheels for another Python than $TAG ($(basename "${OTHER%%$'\n'*}")): not installed"
elif compgen -G "$WHEELS/*.whl" > /dev/null; then
  rm -rf "$SITE" && mkdir -p "$SITE"
  if "$PYTHON" -m pip --version > /dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
      --target "$SITE" "$WHEELS"/*.whl
  else  # no pip on the machine: a wheel is a zip laid out for site-packages
    "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$SITE" "$WHEELS"/*.whl
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH#"$PWD"}"
  echo "[check] $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS installed in $SITE"
fi
"$PYTHON" - "$MIN_TORCH" <<'PY'
import sys
import torch
have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
need = tuple(int(x) for x in sys.argv[1].split("."))
print(f"[check] python {sys.version.split()[0]}, torch {torch.__version__} (minimum {sys.argv[1]})", flush=True)
if have < need:
    sys.exit(f"[check] torch {torch.__version__} is older than {sys.argv[1]}: fully_shard and CPUOffloadPolicy")
PY
exec timeout --signal=INT --kill-after=20 "${CHECK_TIMEOUT_S:-480}" "$PYTHON" bench/gpu/check.py "$@"
