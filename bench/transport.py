"""Handing a tensor to another process: CUDA IPC (same GPU, GPU0 -> GPU1) against protobuf bytes.

    python -m bench.transport --out bench/results/transport-2xh200.json

Per size and route, the producer's put (copy into its pool, synchronised), the message time (the ref
through a pipe, standing in for gRPC), and the consumer's get (read into its own GPU memory,
synchronised). "ready" = put + get: how long after the producer starts handing over the tensor is
in the consumer's hands, message time excluded.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

from bench.results import machine, new_result, write
from omni.stage.v1 import tensor_pb2
from services.runtime.config import TransportConfig

SIZES = {"8KB": 8 << 10, "1MB": 1 << 20, "64MB": 64 << 20}
CFG = TransportConfig(cuda_pool_bytes=1 << 30, max_slots=256, reclaim_after_s=30.0)


def _producer(device: str, nbytes: int, cuda: bool, reps: int, conn) -> None:
    from services.runtime.transport import Transport

    t = Transport(CFG, "benchprod", "local" if cuda else "")
    placement = tensor_pb2.Placement(shm_domain="local", cuda=True)
    x = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    for i in range(reps + 5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        ref = t.put(x, placement)
        data = ref.SerializeToString()
        t1 = time.perf_counter()
        conn.send_bytes(data)
        conn.send((t0, t1))
        conn.recv()  # the consumer is done: the next round starts from a quiet machine
    conn.close()
    time.sleep(0.5)
    t.close()


def _consumer(device: str, reps: int, conn, out) -> None:
    from services.runtime.transport import Transport

    t = Transport(CFG, "benchcons", "local")
    torch.zeros(1, device=device)
    rows = []
    for i in range(reps + 5):
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
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(src, nbytes, cuda, reps, a)), ctx.Process(target=_consumer, args=(dst, reps, b, out))]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    first, rows = rows[0], rows[5:]  # the first get maps the pool: reported apart

    def med(k):
        return statistics.median(r[k] for r in rows)

    put, msg, get = med(0), med(1), med(2)
    return {"bytes": nbytes, "put_us": put * 1e6, "message_us": msg * 1e6, "get_us": get * 1e6, "ready_us": (put + get) * 1e6,
            "get_GBps": nbytes / get / 1e9, "first_get_us": first[2] * 1e6, "reps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    routes = [("same GPU", "cuda:0", "cuda:0")] + ([("GPU0 -> GPU1", "cuda:0", "cuda:1")] if gpus > 1 else [])
    cells = []
    for route, src, dst in routes:
        for label, nbytes in SIZES.items():
            for transport, cuda in (("cuda_ipc", True), ("protobuf bytes", False)):
                cell = {"route": route, "size": label, "transport": transport, **measure(src, dst, nbytes, cuda, args.reps)}
                cells.append(cell)
                print(f"{route:13s} {label:5s} {transport:15s} put {cell['put_us']:9.1f} us  get {cell['get_us']:9.1f} us  "
                      f"ready {cell['ready_us']:9.1f} us  msg {cell['message_us']:8.1f} us  {cell['get_GBps']:7.1f} GB/s  "
                      f"(first get {cell['first_get_us']:.0f} us)", flush=True)
    result = new_result("transport", {"transport": CFG.__dict__}, {}, {"command": "python -m bench.transport " + " ".join(sys.argv[1:])})
    result["machine"], result["cells"] = machine(), cells
    write(result, args.out)


if __name__ == "__main__":
    main()
