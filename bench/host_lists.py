"""What turning a step's host lists into tensors costs the CPU: torch.tensor() against services.llm.host (through
numpy), for a decode step's page ids at 32 requests (512 and 2k tokens each: 1,024 and 4,096 ids) and its
per-row values (32). Pinned where the machine has a GPU, as the engines upload them.

    python -m bench.host_lists --out bench/results/host-lists-cpu.json
"""

import argparse
import sys
import time

import torch

from bench.results import machine, new_result, write
from services.llm.host import _from_lists


def per_call_us(fn, reps: int) -> float:
    for _ in range(max(1, reps // 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=500)
    args = p.parse_args(argv)
    result = new_result("host_lists", {}, {}, {"command": "python -m bench.host_lists " + " ".join(sys.argv[1:] if argv is None else argv)})
    result["machine"] = machine()
    pin = torch.cuda.is_available()
    for n in (32, 1024, 4096):
        values = list(range(n))
        cell = {"values": n, "pinned": pin,
                "torch_tensor_us": per_call_us(lambda: torch.tensor(values, dtype=torch.int32, pin_memory=pin), args.reps),
                "numpy_us": per_call_us(lambda: _from_lists(values, torch.int32, pin), args.reps)}
        cell["speedup"] = cell["torch_tensor_us"] / cell["numpy_us"]
        result["cells"].append(cell)
        print(cell, flush=True)
    write(result, args.out)


if __name__ == "__main__":
    main()
