#!/usr/bin/env bash
# Run here (the CPU machine, with internet) before benchmarks/gpu_checks.sh runs on a GPU machine, which reaches
# nothing: fills .gpu/ (git-ignored) with
#   .gpu/whl/        wheels (Python 3.12, x86-64) of what lmserve and its tests import and the GPU image lacks,
#                    at the versions installed in .venv;
#   .gpu/tokenizer/  the default model's tokenizer as an HF directory: the tiny test models and the benchmark's
#                    random model use it (the model's own GGUF, 98 MB, is more than a device call carries).
# Then the device call: carry [".gpu"], command `bash benchmarks/gpu_checks.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PACKAGES=(
    fastapi starlette uvicorn h11 click anyio pyzmq msgspec pydantic pydantic-core annotated-types
    typing-inspection typing-extensions annotated-doc opentelemetry-api gguf openai httpx2 httpcore2 truststore
    jiter sniffio xgrammar apache-tvm-ffi
)
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

rm -rf .gpu/whl && mkdir -p .gpu/whl
for package in "${PACKAGES[@]}"; do
    version=$("$PY" -m pip show "$package" 2>/dev/null | awk '/^Version:/ {print $2}')
    if [ -z "$version" ]; then
        echo "gpu_prepare: $package is not installed in .venv; skipped" >&2
        continue
    fi
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .gpu/whl "$package==$version"
done

PYTHONPATH=src "$PY" - <<'PYEOF'
from lmserve.models import DEFAULT_MODEL, load_tokenizer, resolve_model

load_tokenizer(resolve_model(DEFAULT_MODEL)).save_pretrained(".gpu/tokenizer")
PYEOF
du -sh .gpu/whl .gpu/tokenizer
