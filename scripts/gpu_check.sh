#!/usr/bin/env bash
# The GPU window, in one command: does a real varlen kernel run, isolate documents and train? Then how fast.
#
#   [WHEELS=DIR] [OUT=DIR] scripts/gpu_check.sh [--quick]
#
# 1. Needs CUDA: on a machine without it, stops at once (exit 2, "needs CUDA" on stderr).
# 2. WHEELS=DIR (from scripts/fetch_wheels.sh): installs packtrain and its dependencies offline into SITE
#    (default /tmp/packtrain_site, then on PYTHONPATH), keeping the machine's torch (scripts/install_wheels.sh).
#    Without WHEELS the Python in PY must have them already.
# 3. tests/test_gpu.py with a JUnit report, read by scripts/gpu_report.py into a table (kernel, available or why
#    not, tests run, passed, forward, backward): it fails unless flash-attn or torch's varlen_attn ran its forward
#    and backward tests and they passed, and no test failed. A skipped kernel is listed, never counted as a pass.
# 4. bench/gpu_train.py: gpt2-124m, bf16, T=2048, packed on the best varlen kernel vs unpacked, the same
#    documents (the demo corpus, built from this machine's standard library into DATA).
# 5. python -m trainer.certify on gpt2-124m, bf16: every kernel this GPU runs against the unpacked fp32 reference;
#    it fails unless a varlen kernel (flash-attn or torch's varlen_attn) ran and passed.
# Everything lands in OUT (default runs/gpu_check/<time>): gpu_check.log, gpu_tests.{xml,md,json},
# gpu_train.{json,md}, certificate/. Exit 0 only if steps 3, 4 and 5 all succeed.
# --quick (under 4 minutes): the flex tests are left out and the benchmark measures for 40 s instead of 120 s.
# The whole script takes under 10 minutes on one H100/H200.
# GPU_CHECK_REHEARSAL=1 runs every step on CPU instead (the tests skip, the benchmark is tiny; the verdict is
# FAIL, as no varlen kernel runs there): tests/test_gpu_scripts.py rehearses the window with it.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done
PY="${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
REHEARSAL="${GPU_CHECK_REHEARSAL:-0}"

# 1. CUDA first: nothing else is worth doing without it.
if [ "$REHEARSAL" != 1 ] && ! why="$("$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")' 2>&1)"; then
    echo "gpu_check.sh needs CUDA: ${why##*$'\n'}" >&2
    exit 2
fi

OUT="${OUT:-runs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)}"
DATA="${DATA:-/tmp/packtrain_gpu_demo}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1  # the log in the order things happened
echo "== gpu_check.sh$([ "$QUICK" = 1 ] && echo " --quick") at $(date -u +%FT%TZ), output in $OUT"
[ "$REHEARSAL" != 1 ] || echo "== REHEARSAL on CPU: no kernel test can run, so the verdict will be FAIL"

# 2. The project and its dependencies, offline; the machine's torch stays.
if [ -n "${WHEELS:-}" ]; then
    SITE="${SITE:-/tmp/packtrain_site}"
    echo "== offline install from $WHEELS into $SITE"
    PY="$PY" scripts/install_wheels.sh "$WHEELS" "$SITE"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" - <<'PYEOF'
import logging
import torch
from trainer.model import flash
from trainer.model.attention import backend_unavailable_reason, resolve_backend
from trainer.run.metrics import peak_flops

logging.basicConfig(level=logging.INFO, format="   %(message)s")
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
name = torch.cuda.get_device_name() if device.type == "cuda" else "no CUDA device"
print(f"== torch {torch.__version__} (CUDA {torch.version.cuda}), {name}, peak dense bf16 "
      f"{(peak_flops(device) or 0) / 1e12:.0f} TFLOP/s (0: unknown device)")
print(f"   flash-attn: {flash.flash_attn_import_error() or 'imports'}")
for kernel in ("flash", "torch_varlen", "flex"):
    print(f"   {kernel} in bf16: {backend_unavailable_reason(kernel, device, torch.bfloat16) or 'available'}")
for dtype in (torch.bfloat16, torch.float32):
    resolve_backend("auto", device, dtype)  # logs its choice and why
PYEOF
then
    echo "gpu_check.sh: packtrain does not import with $PY (see above): pass WHEELS=DIR from scripts/fetch_wheels.sh" >&2
    exit 1
fi

# 3. The GPU tests, then the verdict from their JUnit report.
echo "== GPU tests (tests/test_gpu.py)"
test_args=(-q -rs -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" tests/test_gpu.py)
[ "$QUICK" = 0 ] || test_args+=(-k "not flex")
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then test_args+=(--timeout 150); fi  # one hung test
tests_rc=0
# SIGINT at the limit: pytest stops and still writes the JUnit report of what ran.
timeout -s INT -k 30 "$([ "$QUICK" = 1 ] && echo 100 || echo 270)" "$PY" -m pytest "${test_args[@]}" || tests_rc=$?
echo "== verdict (pytest exit $tests_rc)"
report_rc=0
"$PY" scripts/gpu_report.py "$OUT/gpu_tests.xml" --markdown "$OUT/gpu_tests.md" --json "$OUT/gpu_tests.json" \
    || report_rc=$?
if [ "$tests_rc" != 0 ] && [ "$report_rc" = 0 ]; then
    echo "GPU CHECK: FAIL: pytest exited $tests_rc$([ "$tests_rc" = 124 ] && echo " (stopped at its time limit)")"
    report_rc=1
fi

# 4. The training benchmark.
echo "== training benchmark (bench/gpu_train.py)"
budget="$([ "$QUICK" = 1 ] && echo 40 || echo 120)"
prepare_args=(--source demo --out "$DATA")
bench_args=(--device cuda --model gpt2-124m --vocab-size 50304 --seq-len 2048 --tokens-per-step 65536
            --micro-batch-tokens 32768 --warmup 3 --steps 1000 --time-budget "$budget")
if [ "$REHEARSAL" = 1 ]; then
    prepare_args+=(--max-docs 300 --vocab-size 512)
    bench_args=(--device cpu --model tiny --seq-len 128 --tokens-per-step 1024 --micro-batch-tokens 512 --warmup 1
                --steps 2 --time-budget 0 --threads 1)
fi
bench_rc=0
if [ ! -f "$DATA/manifest.json" ]; then
    timeout 120 "$PY" -m trainer.prepare "${prepare_args[@]}" >/dev/null || bench_rc=$?
fi
if [ "$bench_rc" = 0 ]; then
    timeout "$((budget + 120))" "$PY" bench/gpu_train.py --data "$DATA" --out "$OUT" "${bench_args[@]}" || bench_rc=$?
fi

# 5. The certificate: the same documents in every cell this GPU runs (each kernel, layout and accumulation, bf16)
#    against the unpacked fp32 reference (python -m trainer.certify), on gpt2-124m; it counts only if a varlen
#    kernel (flash-attn or torch's varlen_attn) was among the cells that ran and passed.
echo "== certificate (python -m trainer.certify)"
cert_args=(model=gpt2-124m train.seq_len=2048 train.micro_batch_tokens=4096 --steps 3 --rows 4)
[ "$REHEARSAL" != 1 ] || cert_args=(train.seq_len=128 train.micro_batch_tokens=256 --steps 2 --rows 4)
cert_rc=0
if [ -f "$DATA/manifest.json" ]; then
    timeout 600 "$PY" -m trainer.certify "data.path=$DATA" "${cert_args[@]}" --out "$OUT/certificate" || cert_rc=$?
    [ "$cert_rc" != 0 ] || "$PY" - "$OUT/certificate/certificate.json" <<'PYEOF' || cert_rc=1
import json, sys
cells = json.load(open(sys.argv[1]))["cells"]
ran = sorted({c["backend"] for c in cells if c["status"] == "pass" and c["backend"] in ("flash", "torch_varlen")})
if not ran:
    sys.exit("certificate: no varlen kernel (flash, torch_varlen) ran, so it certifies none: "
             + "; ".join(f"{c['backend']}: {c['skipped']}" for c in cells if c["status"] == "skipped"))
print(f"certificate: varlen kernels certified: {', '.join(ran)}")
PYEOF
else
    cert_rc=1
fi

echo "== summary"
cat "$OUT/gpu_tests.md" 2>/dev/null || echo "(no test report)"
[ "$bench_rc" = 0 ] && echo "benchmark: $OUT/gpu_train.md" || echo "benchmark FAILED (exit $bench_rc)"
[ "$cert_rc" = 0 ] && echo "certificate: $OUT/certificate/certificate.md" || echo "certificate FAILED (exit $cert_rc)"
[ "$report_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$cert_rc" = 0 ]
