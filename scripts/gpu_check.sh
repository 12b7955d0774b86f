#!/usr/bin/env bash
# The trainer's CUDA path on a real GPU (see scripts/gpu_check.py): CPU/CUDA parity of one step and
# plan-memory against torch.cuda.max_memory_allocated. Run from the repo root on a CUDA machine that
# has torch, transformers and peft. Python packages it lacks can sit as wheels in .whl/ (docs/gpu.md,
# "On a GPU", lists them); they are installed to /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py "$@"
