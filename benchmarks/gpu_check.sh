#!/usr/bin/env bash
# The GPU check of issue 11, as one call on one GPU (an H200: well under 8 minutes; every step has a
# timeout, together 7 min 45 s at most):
#   1. tests that need CUDA: trainer.backend megatron equals the torch trainer on one batch (fp32, 1e-4:
#      π_old logprobs, PPO loss, grad norm, weights after the distributed optimizer's step, HF export),
#      the broadcast weight transport between two processes on CUDA (gloo; NCCL needs two GPUs and skips
#      on one, saying so), the megatron conversion tests;
#   2. benchmarks/gpu_check.py: megatron vs torch backends in bf16 on a 8-layer 1024-wide model (loss and
#      grad norm within 2e-2, trained tokens/s of both), one JSON line.
# Results go to $OUT (the device tool's folder) or benchmarks/results/.
#
# Wheels the GPU machine lacks (Python 3.12; it has torch, transformers, pyarrow, pytest, pyyaml, numpy,
# setuptools, but no pydantic and no megatron-core), 5.4 MB together:
#   megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
# Fetch them here once:      bash benchmarks/gpu_check.sh --fetch-wheels      (into .whl/, git-ignored)
# Then on the device:        run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=480)
# rlpipe itself is built from this checkout there (setuptools, no network) into the same --target folder.
#
# Status: written for a GPU machine; not run in the task that added it (no GPU was lent).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
    # shellcheck disable=SC2086  # one argument per wheel
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS
    exit 0
fi

OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
SITE=/tmp/rlpipe-site
if [[ -d .whl ]]; then
    timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl
fi
# rlpipe from this checkout (stages/ and schemas/ map into rlpipe.* only through an install)
timeout 45 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
    --target "$SITE" . >/dev/null
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "megatron.core", "pydantic", "pyarrow", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing {missing}; carry the wheels listed at the top of benchmarks/gpu_check.sh")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device")
print("gpu_check:", torch.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), "device(s)")
PY

status=0
: > "$OUT/gpu_tests.log"
# One pytest process per file: the megatron tests set up torch.distributed and megatron's parallel state
# (a one-rank group) differently, once per process. -P: the checkout's own rlpipe/ folder must not shadow
# the installed rlpipe (which holds rlpipe.stages and rlpipe.schemas).
for file in tests/stages/test_update_megatron.py tests/backends/test_weight_broadcast.py \
            tests/backends/test_megatron_convert.py; do
    timeout 90 python3 -P -m pytest -p no:cacheprovider -rs -q "$file" 2>&1 | tee -a "$OUT/gpu_tests.log" \
        || status=$?
done
timeout 120 python3 -P benchmarks/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log" || status=$?
exit "$status"
