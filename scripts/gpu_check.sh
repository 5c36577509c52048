#!/usr/bin/env bash
# On a CUDA machine: the GPU tests, then a short attention benchmark (a few minutes in all).
# Prints the results; exits non-zero if CUDA is missing, a test fails or a benchmark step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"

"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device"
from trainer.model import flash
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
      f"flash-attn: {flash.flash_attn_import_error() or 'importable'}")
PYEOF

echo "== GPU tests"
"$PY" -m pytest -q -rs tests/test_gpu.py

echo "== attention benchmark (bf16, forward + backward)"
timeout 420 "$PY" bench/attention.py --device cuda --min-n 1024 --max-n 32768 --repeats 5 \
    --dense-max-gb 8 --json "${BENCH_JSON:-/tmp/attention_bench_cuda.json}"
