"""Handing a tensor to another process: CUDA IPC (same GPU, GPU0 -> GPU1) against protobuf bytes.

    python -m bench.transport --out bench/results/transport-2xh200.json

Per size and route, the producer's put (copy into its pool, synchronised), the message time (the ref
through a pipe, standing in for gRPC), and the consumer's get (read into its own GPU memory,
synchronised). "ready" = put + get: how long after the producer starts handing over the tensor is
in the consumer's hands, message time excluded. --cross-gpu-read source,pull measures both ways a GPU reads
another GPU's pool (transport.cross_gpu_read), --ipc-events off,on a put that waits for its copy against one
whose consumer waits on the device (transport.ipc_events). --waits sleep,spin: between rounds each side blocks on
the pipe (its thread descheduled, as a stage's thread waiting for its next request is) or polls it without
sleeping: how much of a put's and a get's fixed cost is the thread and the GPU waking up, not the transport.
With --profile DIR, each side's measured puts or gets run under cProfile, its busiest functions written to DIR.
"""

import argparse
import dataclasses
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time

import torch

from bench.results import machine, new_result, write
from omni.stage.v1 import tensor_pb2
from services.runtime.config import TransportConfig

SIZES = {"8KB": 8 << 10, "1MB": 1 << 20, "64MB": 64 << 20}
CFG = TransportConfig(cuda_pool_bytes=1 << 30, max_slots=256, reclaim_after_s=30.0)


class _Profile:
    """cProfile over a side's measured rounds when `path` is set; its busiest functions written there at the end."""

    def __init__(self, path: str):
        self.path, self.prof = path, cProfile.Profile() if path else None

    def start(self) -> None:
        if self.prof:
            self.prof.enable()

    def stop(self) -> None:
        if self.prof:
            self.prof.disable()

    def finish(self) -> None:
        if self.prof:
            text = io.StringIO()
            pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(30)
            with open(self.path, "w") as f:
                f.write(text.getvalue())


def _wait(conn, spin: bool) -> None:
    """Until `conn` has something to read: polling it in a loop (`spin`), else blocked in the kernel."""
    while spin and not conn.poll(0):
        pass


def _producer(cfg: TransportConfig, device: str, nbytes: int, cuda: bool, reps: int, conn, profile: str = "",
              spin: bool = False) -> None:
    from services.runtime.transport import Transport

    t = Transport(cfg, "benchprod", "local" if cuda else "")
    placement = tensor_pb2.Placement(shm_domain="local", cuda=True)
    x = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    prof = _Profile(profile)
    for i in range(reps + 5):
        if x.is_cuda:
            torch.cuda.synchronize(device)
        if i >= 5:  # the measured rounds
            prof.start()
        t0 = time.perf_counter()
        ref = t.put(x, placement)
        data = ref.SerializeToString()
        t1 = time.perf_counter()
        prof.stop()
        conn.send_bytes(data)
        conn.send((t0, t1))
        _wait(conn, spin)
        conn.recv()  # the consumer is done: the next round starts from a quiet machine
    prof.finish()
    conn.close()
    time.sleep(0.5)
    t.close()


def _consumer(cfg: TransportConfig, device: str, reps: int, conn, out, profile: str = "", spin: bool = False) -> None:
    from services.runtime.transport import Transport

    t = Transport(cfg, "benchcons", "local")
    torch.zeros(1, device=device)
    rows = []
    prof = _Profile(profile)
    for i in range(reps + 5):
        _wait(conn, spin)
        data = conn.recv_bytes()
        t0, t1 = conn.recv()
        if i >= 5:
            prof.start()
        t2 = time.perf_counter()
        got = t.get(tensor_pb2.TensorRef.FromString(data), device)
        t3 = time.perf_counter()
        prof.stop()
        assert got.device == torch.device(device)
        conn.send(None)
        rows.append((t1 - t0, t2 - t1, t3 - t2))
    prof.finish()
    out.put(rows)


def measure(cfg: TransportConfig, src: str, dst: str, nbytes: int, cuda: bool, reps: int, profile: str = "",
            spin: bool = False) -> dict:
    """One cell; with `profile` (a path prefix), each side's cProfile report at PREFIX-put.txt and PREFIX-get.txt;
    with `spin`, both sides poll the pipe between rounds instead of sleeping on it."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(cfg, src, nbytes, cuda, reps, a, profile and f"{profile}-put.txt", spin)),
             ctx.Process(target=_consumer, args=(cfg, dst, reps, b, out, profile and f"{profile}-get.txt", spin))]
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    parser.add_argument("--routes", default="same,across", help="same: GPU0 to GPU0; across: GPU0 to GPU1")
    parser.add_argument("--transports", default="cuda_ipc,bytes")
    parser.add_argument("--profile", default="", help="a folder for each side's cProfile report of each cell")
    parser.add_argument("--read-lanes", type=int, default=1, help="transport.read_lanes: parts of a large read from another GPU")
    parser.add_argument("--cross-gpu-read", default="source",
                        help="transport.cross_gpu_read, one or more of source,pull: across GPUs, a cell for each")
    parser.add_argument("--ipc-events", default="off",
                        help="transport.ipc_events, one or more of off,on: CUDA IPC cells for each")
    parser.add_argument("--waits", default="sleep", help="one or more of sleep,spin: how each side waits between rounds")
    args = parser.parse_args(argv)
    if set(args.waits.split(",")) - {"sleep", "spin"}:
        parser.error(f"--waits takes sleep and/or spin, not {args.waits!r}")
    cfg = dataclasses.replace(CFG, read_lanes=args.read_lanes)
    gpus = torch.cuda.device_count()
    routes = {"same": ("same GPU", "cuda:0", "cuda:0"), "across": ("GPU0 -> GPU1", "cuda:0", "cuda:1")}
    routes = [routes[r] for r in args.routes.split(",") if r == "same" or gpus > 1]
    transports = {"cuda_ipc": ("cuda_ipc", True), "bytes": ("protobuf bytes", False)}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    command = "python -m bench.transport " + " ".join(sys.argv[1:] if argv is None else argv)
    result = new_result("transport", {"transport": cfg.__dict__}, {}, {"command": command})
    result["machine"], result["cells"] = machine(), []
    for route, src, dst in routes:
        for label in args.sizes.split(","):
            nbytes = SIZES[label]
            for key in args.transports.split(","):
                transport, cuda = transports[key]
                reads = args.cross_gpu_read.split(",") if cuda and src != dst else ["source"]
                events = args.ipc_events.split(",") if cuda else ["off"]
                for read, ev, wait in [(r, e, w) for r in reads for e in events for w in args.waits.split(",")]:
                    name = ", ".join([transport] + ([read] if len(reads) > 1 or read != "source" else [])
                                     + (["events"] if ev == "on" else []) + (["spin"] if wait == "spin" else []))
                    profile = args.profile and os.path.join(args.profile, f"{src[-1]}to{dst[-1]}-{label}-{key}-{read}-{ev}-{wait}")
                    variant = dataclasses.replace(cfg, cross_gpu_read=read, ipc_events=ev == "on")
                    cell = {"route": route, "size": label, "transport": name, "cross_gpu_read": read, "ipc_events": ev == "on",
                            "waits": wait, **measure(variant, src, dst, nbytes, cuda, args.reps, profile, wait == "spin")}
                    result["cells"].append(cell)
                    write(result, args.out)  # after every cell: a run cut short keeps what it measured
                    print(f"{route:13s} {label:5s} {name:22s} put {cell['put_us']:9.1f} us  get {cell['get_us']:9.1f} us  "
                          f"ready {cell['ready_us']:9.1f} us  msg {cell['message_us']:8.1f} us  {cell['get_GBps']:7.1f} GB/s  "
                          f"(first get {cell['first_get_us']:.0f} us)", flush=True)


if __name__ == "__main__":
    main()
