#!/usr/bin/env bash
# Everything this repository checks on a GPU, in one device call of under 10 minutes:
#   1. benchmarks/gpu_prepare.sh, here on the CPU machine (wheels and the tokenizer into .gpu/);
#   2. the device call: carry [".gpu"], command `bash benchmarks/gpu_checks.sh`, timeout_s 600.
# It installs the carried wheels, runs tests/gpu (bf16 parity with transformers on a mixed batch, the server end to
# end on CUDA, prefix caching, aborts, --gpu-memory-utilization; issue 37's scale-out: -dp 2 replicas on the GPUs,
# and on a machine with two GPUs or more -tp 2 / -pp 2 over NCCL against one rank's tokens), then
# benchmarks/gpu_w1_w4.py, and writes to $OUT:
# env.txt, tests_gpu.log, tests_gpu.xml, gpu_w1_w4.log, gpu_w1_w4.json, summary.txt.
# Each stage has its own time limit, so a hang in one still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ -d .gpu/whl ] && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl || { echo "gpu_checks: installing the carried wheels failed" | tee "$OUT/summary.txt"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .gpu/tokenizer ]; then export LMSERVE_TEST_TOKENIZER="$PWD/.gpu/tokenizer"; fi

{
    nvidia-smi || true
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1

timeout 300 "$PY" -m pytest -v -s -p no:cacheprovider --junitxml="$OUT/tests_gpu.xml" tests/gpu \
    > "$OUT/tests_gpu.log" 2>&1
tests_rc=$?
tail -n 25 "$OUT/tests_gpu.log"

timeout 240 "$PY" benchmarks/gpu_w1_w4.py --out "$OUT/gpu_w1_w4.json" > "$OUT/gpu_w1_w4.log" 2>&1
bench_rc=$?
grep -v " INFO " "$OUT/gpu_w1_w4.log" | tail -n 12

echo "tests/gpu exit $tests_rc; gpu_w1_w4 exit $bench_rc (124: timed out)" | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
