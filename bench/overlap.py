"""Does a copy on a stream of its own return while the stage's stream is still busy? The transport's puts
and gets copy on their own streams so that they wait for their data alone, not for the engine's next step;
this checks each way of copying against a stream kept busy by a spinning kernel (about 0.3 s).

    python -m bench.overlap --out bench/results/overlap-2xh200.json

Per variant: the host's time for the copy (until its stream is synchronised) and whether the busy stream
was still busy after it. A copy that waited for the busy stream takes about the spin's length.
"""

import argparse
import json
import time

import torch

from bench.results import write

SPIN_CYCLES = 600_000_000  # ~0.3 s at the H200's ~2 GHz
NBYTES = 1 << 20


def _spin(stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN_CYCLES)


def _timed(copy, busy: torch.cuda.Stream) -> dict:
    t0 = time.perf_counter()
    copy()
    seconds = time.perf_counter() - t0
    still_busy = not busy.query()
    torch.cuda.synchronize()
    return {"copy_ms": round(seconds * 1000, 3), "busy_stream_still_busy": still_busy}


def variants(devices: list[str]) -> dict:
    dev = torch.device(devices[0])
    src = torch.randint(0, 255, (NBYTES,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    legacy = torch.cuda.default_stream(dev)
    engine = torch.cuda.Stream(dev)  # what a stage would get by running its engine on a stream of its own
    side = torch.cuda.Stream(dev)
    out = {}

    def on(stream, fn):
        def run():
            with torch.cuda.stream(stream):
                fn()
            stream.synchronize()
        return run

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _spin(legacy)
    legacy.synchronize()
    out["spin alone"] = {"spin_ms": round((time.perf_counter() - t0) * 1000, 1)}
    for busy_name, busy in (("default stream busy", legacy), ("engine stream busy", engine)):
        _spin(busy)
        out[f"{busy_name}: memcpy on a side stream"] = _timed(on(side, lambda: dst.copy_(src)), busy)
        _spin(busy)
        out[f"{busy_name}: kernel copy on a side stream"] = _timed(
            on(side, lambda: torch.bitwise_or(src, 0, out=dst)), busy)
        _spin(busy)
        fresh = {}
        out[f"{busy_name}: memcpy on a stream created while busy"] = _timed(
            lambda: (fresh.setdefault("s", torch.cuda.Stream(dev)), on(fresh["s"], lambda: dst.copy_(src))()), busy)
        _spin(busy)
        out[f"{busy_name}: pinned host copy on a side stream"] = _timed(
            on(side, lambda: torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True).copy_(src, non_blocking=True)), busy)
    if len(devices) > 1:  # a read into another GPU whose own default stream is busy
        other = torch.device(devices[1])
        other_side = torch.cuda.Stream(other)
        _spin(torch.cuda.default_stream(other))
        out["other GPU's default stream busy: peer copy on its side stream"] = _timed(
            on(other_side, lambda: src.to(other, copy=True)), torch.cuda.default_stream(other))
    _spin(legacy)
    from services.runtime.cuda_ipc import CudaPool

    pool = CudaPool("overlap", dev, 8 << 20, 16, 30.0)
    try:
        ready = torch.cuda.Event()
        ready.record(engine)
        _spin(legacy)
        out["default stream busy: CudaPool.put after a ready event"] = _timed(lambda: pool.put([src], ready), legacy)
    finally:
        pool.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="")
    args = p.parse_args()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if not devices:
        raise SystemExit("needs a GPU")
    result = {"devices": [torch.cuda.get_device_name(d) for d in devices], "torch": torch.__version__,
              "spin_cycles": SPIN_CYCLES, "nbytes": NBYTES, "variants": variants(devices)}
    print(json.dumps(result, indent=1))
    if args.out:
        write(result, args.out)


if __name__ == "__main__":
    main()
