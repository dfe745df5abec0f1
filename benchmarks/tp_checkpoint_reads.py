"""What one tensor-parallel rank reads of a safetensors checkpoint: whole tensors (part=None, as before issue 37's
item 6) against the rank's share (LlamaForCausalLM.checkpoint_part). Float32 bytes handed to the model, load time and
peak RSS per rank of -tp 3, each (rank, mode) in a fresh process, three rounds alternating; medians.

    .venv/bin/python benchmarks/export_hf.py /tmp/smol-hf --dtype bfloat16
    .venv/bin/python benchmarks/tp_checkpoint_reads.py /tmp/smol-hf
"""

import statistics
import subprocess
import sys

CODE = r'''
import sys, time, resource, torch
from lmserve.distributed.parallel_state import ParallelGroups, RankLayout
from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.weights.loader import load_weights
from lmserve.worker.models.llama import LlamaForCausalLM
rank, part = int(sys.argv[1]), sys.argv[2] == "part"
source = resolve_model(sys.argv[3]); config = load_hf_config(source)
model = LlamaForCausalLM(config, 2048, ParallelGroups(RankLayout(rank, tp_size=3)))
nbytes = 0
def counted(weights):
    global nbytes
    for name, t in weights:
        nbytes += t.nbytes
        yield name, t
start = time.perf_counter()
model.load_weights(counted(load_weights(source, torch.float32, wanted=model.wants, part=model.checkpoint_part if part else None)))
print(nbytes, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
'''
rows: dict[str, list] = {}
for _ in range(3):
    for mode in ("whole", "part"):
        for rank in range(3):
            out = subprocess.run([sys.executable, "-c", CODE, str(rank), mode, sys.argv[1]],
                                 capture_output=True, text=True, check=True).stdout.split()
            rows.setdefault(mode, []).append((int(out[0]), float(out[1]), int(out[2])))
for mode, r in rows.items():
    print(f"{mode}: float32 bytes handed to the model per rank {statistics.median(x[0] for x in r) / 1e6:.1f} MB, "
          f"load {statistics.median(x[1] for x in r):.3f} s, "
          f"peak RSS {statistics.median(x[2] for x in r) / 1024:.0f} MiB (medians of {len(r)})")
