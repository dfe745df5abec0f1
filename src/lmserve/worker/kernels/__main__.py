"""Build the CPU kernels ahead of time: `python -m lmserve.worker.kernels`."""

from lmserve.worker.kernels import build_directory, paged_attention_op

paged_attention_op()
print(f"paged-attention kernel ready in {build_directory()}")
