"""What a decode step's kind of host work costs on this machine, and whether the wait before it changes that.

    python -m bench.callcost [--out FILE.json] [--steps N] [--device_ms MS]

A step's host work, in the engines, runs right after a wait of about a step's device time (15 ms for the thinker
at 32 requests) for the previous step's tokens. On the lent H200s (Firecracker VMs) the same host work cost 5-10
times what it costs in a tight loop, so this measures one piece of work (`work()`: a few numpy ops on a batch's
arrays, a Python loop over 32 rows, and the CUDA calls a step makes: a pinned copy each way, an event record and
a graph launch) in each of these settings, `steps` times each:
- idle: back to back, the device idle;
- busy: the device running a kernel of `device_ms` queued just before;
- after_block / after_spin / after_sleep_spin: after a wait for such a kernel, blocked in the driver (what the
  engines do), polling its event, or asleep for all but the last millisecond and polling that, with the next
  kernel already queued (the device busy, as in an overlapped decode loop).
It also gives each call's cost in a tight loop, the clock source, and whether pinned host memory can stand for a
CUDA tensor (a graph writing into it).
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch

from bench.results import git_state, machine, write


def per_call_us(f, n: int = 2000) -> float:
    t = time.perf_counter_ns()
    for _ in range(n):
        f()
    return (time.perf_counter_ns() - t) / n / 1000


class _Alias:
    """Pinned host memory as __cuda_array_interface__ describes it (torch.as_tensor then makes a CUDA tensor of it)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<i8", "data": (t.data_ptr(), False),
                                         "version": 3}


def mapped_write() -> list[int]:
    """Row 1 of a pinned [2, 32] buffer (-1s) after a captured graph writes 3 * arange(32) into it by an index on the
    device, and row 0's first value (still -1)."""
    host = torch.full((2, 32), -1, dtype=torch.long, pin_memory=True)
    dev = torch.as_tensor(_Alias(host), device="cuda")
    assert dev.device.type == "cuda" and dev.data_ptr() == host.data_ptr()
    row, y = torch.tensor([1], device="cuda"), torch.arange(32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dev.index_copy_(0, row, (y * 3)[None])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    host.fill_(-1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dev.index_copy_(0, row, (y * 3)[None])
    graph.replay()
    torch.cuda.synchronize()
    return host[1, :4].tolist() + [host[0, 0].item()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device_ms", type=float, default=15.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    out: dict = {}
    for name in ("current_clocksource", "available_clocksource"):
        try:
            out[name] = open(f"/sys/devices/system/clocksource/clocksource0/{name}").read().strip()
        except OSError:
            pass
    a = np.zeros(32, np.int32)
    out["tight_us"] = {"perf_counter": per_call_us(time.perf_counter, 20000),
                       "thread_time": per_call_us(time.thread_time, 20000),
                       "np_iadd_32": per_call_us(lambda: a.__iadd__(1), 20000),
                       "np_flatnonzero_32": per_call_us(lambda: np.flatnonzero(a == 16), 20000)}
    dev = torch.device("cuda")
    x = torch.zeros(32, dtype=torch.long, device=dev)
    h = torch.zeros(32, dtype=torch.long, pin_memory=True)
    e = torch.cuda.Event()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        x.add_(1)
    torch.cuda.synchronize()
    out["tight_us"].update({"event_record": per_call_us(e.record), "event_query_done": per_call_us(e.query),
                            "event_sync_done": per_call_us(e.synchronize),
                            "h2d_pinned": per_call_us(lambda: x.copy_(h, non_blocking=True)),
                            "d2h_pinned": per_call_us(lambda: h.copy_(x, non_blocking=True)),
                            "kernel": per_call_us(lambda: x.fill_(1)), "graph_launch": per_call_us(g.replay)})
    torch.cuda.synchronize()
    try:
        out["mapped_write"] = mapped_write()
    except Exception as ex:  # noqa: BLE001 - a finding, not a failure of the run
        out["mapped_write"] = repr(ex)

    # Cycles of torch.cuda._sleep for device_ms
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    stop.record()
    stop.synchronize()
    cycles = int(10_000_000 * args.device_ms / start.elapsed_time(stop))
    rows = [{"generated": list(range(100)), "done": False, "n": i} for i in range(32)]
    last, slots = np.zeros(32, np.int32), np.zeros(32, np.int64)
    done = torch.cuda.Event()

    def work() -> tuple[float, float]:
        """(host ms of numpy and Python, host ms of CUDA calls)"""
        t0 = time.perf_counter()
        full = np.flatnonzero(last == 16)
        last[:] += 1
        slots[:] += 1
        pages = np.diff(np.concatenate(([0], np.cumsum(last))))
        same = bool((pages >= 0).all()) and len(full) >= 0  # (numpy work of a plan's kind; its result unused)
        picked = [r["generated"][-1] + r["n"] for r in rows if not r["done"] and same]
        for r, t in zip(rows, picked):
            r["generated"].append(t)
            del r["generated"][0]
        t1 = time.perf_counter()
        x.copy_(h, non_blocking=True)
        g.replay()
        h.copy_(x, non_blocking=True)
        done.record()
        t2 = time.perf_counter()
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1)

    def wait(event: torch.cuda.Event, mode: str, until: float) -> None:
        if mode == "block":
            event.synchronize()
        elif mode == "spin":
            while not event.query():
                pass
        else:  # asleep to a millisecond before the kernel's expected end, then polling
            if until - time.perf_counter() > 1e-3:
                time.sleep(until - time.perf_counter() - 1e-3)
            while not event.query():
                pass

    results = {}
    for setting in ("idle", "busy", "after_block", "after_spin", "after_sleep_spin"):
        cpu, cuda = [], []
        torch.cuda.synchronize()
        ev = torch.cuda.Event()
        queued = None  # when the kernel the next wait is for was queued (the device idle or about to be)
        for _ in range(args.steps):
            if setting == "idle":
                torch.cuda.synchronize()
            elif setting == "busy":
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)
            else:
                if queued is None:
                    queued = time.perf_counter()
                    torch.cuda._sleep(cycles)
                ev.record()
                wait(ev, setting[len("after_"):], queued + args.device_ms / 1e3)
                queued = time.perf_counter()
                torch.cuda._sleep(cycles)  # the next step, running while the host works
            c, k = work()
            cpu.append(c)
            cuda.append(k)
        torch.cuda.synchronize()
        results[setting] = {"cpu_ms_p50": statistics.median(cpu), "cpu_ms_p90": sorted(cpu)[int(0.9 * len(cpu))],
                            "cuda_ms_p50": statistics.median(cuda), "cuda_ms_p90": sorted(cuda)[int(0.9 * len(cuda))]}
        print(setting, {k: round(v, 4) for k, v in results[setting].items()}, flush=True)
    out.update(work=results, steps=args.steps, device_ms=args.device_ms, machine=machine(), **git_state())
    print(json.dumps(out, indent=1))
    if args.out:
        write(out, args.out)


if __name__ == "__main__":
    main()
