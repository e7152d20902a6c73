#!/usr/bin/env bash
# megatron-core vs transformers on one GPU (benchmarks/gpu_check.py): loss, grad norm, tokens/s.
#
# Needs, on the GPU machine: a CUDA torch (>= 2.4), transformers, numpy, packaging, and
#   megatron-core==0.16.1   (pure-python wheel; pip install --no-deps megatron-core==0.16.1)
#   this checkout (rlpipe.backends.megatron_convert is imported from the source tree; rlpipe's own
#   dependencies such as Ray and MLflow are not needed for this check).
# Optional: transformer-engine / apex (the check uses megatron's local layer spec, no fusions).
# Status: written for a GPU machine; not run in the task that added it (no GPU was lent).
#
# Usage: bash benchmarks/gpu_check.sh [gpu_check.py args, e.g. --family llama --layers 16]
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "transformers", "megatron.core") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing {missing}; pip install --no-deps megatron-core==0.16.1 (and a CUDA torch, transformers)")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device")
PY
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python benchmarks/gpu_check.py "$@"
