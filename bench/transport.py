"""Handing a tensor to another process: CUDA IPC (same GPU, GPU0 -> GPU1) against protobuf bytes.

    python -m bench.transport --out bench/results/transport-1xh200-COMMIT.json

Per size and route (services.runtime.transport at its defaults): the producer's put, the message time (the ref
through a pipe, standing in for gRPC), the consumer's get into its own memory; "ready" = put + get.
"""

import argparse
import multiprocessing as mp
import shlex
import statistics
import sys
import time

import torch

from bench.results import machine, new_result, write
from omni.stage.v1 import tensor_pb2
from services.runtime.config import TransportConfig

SIZES = {"8KB": 8 << 10, "1MB": 1 << 20, "64MB": 64 << 20}
WARM = 5  # rounds before the measured ones (the first get maps the pool: reported apart)


def _producer(device: str, nbytes: int, cuda: bool, reps: int, conn) -> None:
    from services.runtime.transport import SHM_DOMAIN, Transport

    t = Transport(TransportConfig(), "benchprod")
    # CUDA IPC: a consumer on this host that takes GPU memory; bytes: no placement, so the tensor goes in the message
    placement = tensor_pb2.Placement(shm_domain=SHM_DOMAIN, cuda=True) if cuda else None
    x = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    for _ in range(reps + WARM):
        if x.is_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        data = t.put(x, placement).SerializeToString()
        t1 = time.perf_counter()
        conn.send_bytes(data)
        conn.send((t0, t1))
        conn.recv()  # the consumer is done: the next round starts from a quiet machine
    conn.close()
    time.sleep(0.5)
    t.close()


def _consumer(device: str, reps: int, conn, out) -> None:
    from services.runtime.transport import Transport

    t = Transport(TransportConfig(), "benchcons")
    torch.zeros(1, device=device)
    rows = []
    for _ in range(reps + WARM):
        data = conn.recv_bytes()
        t0, t1 = conn.recv()
        t2 = time.perf_counter()
        got = t.get(tensor_pb2.TensorRef.FromString(data), device)
        t3 = time.perf_counter()
        assert got.device == torch.device(device)
        conn.send(None)
        rows.append((t1 - t0, t2 - t1, t3 - t2))
    out.put(rows)


def measure(src: str, dst: str, nbytes: int, cuda: bool, reps: int) -> dict:
    """One cell: `reps` hand-overs of `nbytes` from a process on `src` to one on `dst`, medians in us."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(src, nbytes, cuda, reps, a)), ctx.Process(target=_consumer, args=(dst, reps, b, out))]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    first, rows = rows[0], rows[WARM:]
    put, msg, get = (statistics.median(r[k] for r in rows) for k in range(3))
    return {"bytes": nbytes, "put_us": put * 1e6, "message_us": msg * 1e6, "get_us": get * 1e6, "ready_us": (put + get) * 1e6,
            "get_GBps": nbytes / get / 1e9, "first_get_us": first[2] * 1e6, "reps": len(rows)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    p.add_argument("--routes", default="same,across", help="same: GPU0 to GPU0; across: GPU0 to GPU1 (where there are two)")
    p.add_argument("--transports", default="cuda_ipc,bytes")
    p.add_argument("--device", default="cuda", help="cpu: both sides on the CPU (the tests)")
    args = p.parse_args(argv)
    gpus, first = (torch.cuda.device_count(), "cuda:0") if args.device == "cuda" else (1, args.device)
    routes = {"same": ("same GPU", first, first), "across": ("GPU0 -> GPU1", "cuda:0", "cuda:1")}
    routes = [routes[r] for r in args.routes.split(",") if r == "same" or gpus > 1]
    names = {"cuda_ipc": "cuda_ipc", "bytes": "protobuf bytes"}
    command = "python -m bench.transport " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = new_result("transport", {"transport": TransportConfig().__dict__}, {}, {"command": command})
    result["machine"] = machine()
    for route, src, dst in routes:
        for size in args.sizes.split(","):
            for key in args.transports.split(","):
                cell = {"route": route, "size": size, "transport": names[key],
                        **measure(src, dst, SIZES[size], key == "cuda_ipc", args.reps)}
                result["cells"].append(cell)
                write(result, args.out)  # after every cell: a run cut short keeps what it measured
                print(f"{route:13s} {size:5s} {names[key]:15s} put {cell['put_us']:9.1f} us  get {cell['get_us']:9.1f} us  "
                      f"ready {cell['ready_us']:9.1f} us  msg {cell['message_us']:8.1f} us  {cell['get_GBps']:7.1f} GB/s  "
                      f"(first get {cell['first_get_us']:.0f} us)", flush=True)
    return result


if __name__ == "__main__":
    main()
