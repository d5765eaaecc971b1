#!/usr/bin/env bash
# The GPU check (bench/gpu/check.py): LLaDA-8B-shaped rollouts and LoRA / full fine-tuning steps on one
# GPU, at most 8 minutes, report.json + report.md in the output directory ($OUT on the device machine).
#
#   bash bench/gpu/check.sh                 # one H200: the full check (writes $OUT, else runs/gpu_check)
#   bash bench/gpu/check.sh --tiny          # the same code paths on the CPU in seconds (make test runs it)
#   bash bench/gpu/check.sh --only rollout  # one section (matmul always runs: MFU needs its peak)
#
# PYTHON picks the interpreter (default: .venv/bin/python when present, else python3, the one that
# holds PyTorch on the device machine). CHECK_TIMEOUT_S (default 480) is the hard limit: the script
# is interrupted then, and every section finished before it is already in the report.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=INT --kill-after=20 "${CHECK_TIMEOUT_S:-480}" "$PYTHON" bench/gpu/check.py "$@"
