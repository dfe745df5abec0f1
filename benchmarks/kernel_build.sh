#!/bin/sh
# Builds lmserve's CPU kernels from scratch, as a first start does: SRC is a tree's `src` folder (compare two commits
# by exporting each with `git archive COMMIT src | tar -x -C DIR`), CACHE a folder this script empties first.
# Time it as a whole process, e.g. two trees in alternating runs:
#   benchmarks/kernel_build.sh /tmp/new/src /tmp/cache-new   vs   benchmarks/kernel_build.sh /tmp/old/src /tmp/cache-old
# LMSERVE_KERNEL_MARCH=haswell builds the AVX2 kind's library instead of this CPU's.
set -e
[ $# -eq 2 ] || { echo "usage: $0 SRC CACHE" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
[ ! -e "$2" ] || [ -d "$2/kernels" ] || { echo "refusing to empty $2: it holds no kernel cache" >&2; exit 2; }
rm -rf "$2"
LMSERVE_CACHE="$2" PYTHONPATH="$1" exec "$here/.venv/bin/python" -m lmserve.worker.kernels
