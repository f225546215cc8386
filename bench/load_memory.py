"""Load time and peak resident memory of loading a model and running one forward, relative to the GGUF size.

    python bench/load_memory.py [--model PATH]

Runs the load in a fresh subprocess so the peak (ru_maxrss) belongs to it alone; the baseline is the
same process after importing torch and workbench, before loading.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import time
started = time.perf_counter()
import json, resource, sys, torch
import workbench
import_s = time.perf_counter() - started
from workbench.loading import default_model_path
torch.set_num_threads(2)
path = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
model = workbench.load(path, device="cpu")
load_s = time.perf_counter() - start
model.forward("The capital of France is")
first_s = time.perf_counter() - start - load_s
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"import_s": import_s, "first_forward_s": first_s, "load_s": load_s, "baseline_bytes": before, "peak_bytes": peak,
                  "file_bytes": model.path.stat().st_size, "weight_bytes": model.runner.weights.nbytes}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    out = subprocess.run([sys.executable, "-c", CHILD, args.model], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    added = r["peak_bytes"] - r["baseline_bytes"]
    print(f"import workbench     {r['import_s']:.2f} s")
    print(f"load time            {r['load_s']:.2f} s")
    print(f"first forward        {r['first_forward_s']:.2f} s (6 tokens; loads the C++ kernels)")
    print(f"GGUF file            {r['file_bytes'] / mib:.1f} MiB")
    print(f"resident weights     {r['weight_bytes'] / mib:.1f} MiB ({r['weight_bytes'] / r['file_bytes']:.2f}x file)")
    print(f"peak RSS added       {added / mib:.1f} MiB ({added / r['file_bytes']:.2f}x file) over a "
          f"{r['baseline_bytes'] / mib:.0f} MiB baseline (python + torch)")


if __name__ == "__main__":
    main()
