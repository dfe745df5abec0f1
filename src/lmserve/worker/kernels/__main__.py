"""Build the CPU kernels ahead of time: `python -m lmserve.worker.kernels`."""

from lmserve.worker.kernels import build_directory, cpu_kernels

cpu_kernels()
print(f"lmserve's CPU kernels ready in {build_directory()}")
