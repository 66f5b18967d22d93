"""The reliability battery of a mesh: capacity at t2t and t2s, an open-loop overload at a multiple of it (goodput,
how fast refusals come, admitted requests' TTFT and TTFA against unloaded), each stage kind killed and its recovery
timed, and a soak's slopes.

    python -m bench.battery --config configs/local.yaml --out .cache/battery.json [--overload 5] [--soak-minutes 2]
        [--phases overload,kill,soak] [--log-dir DIR]
"""

import argparse
import asyncio
import json
import random
import signal
import time
from pathlib import Path

import grpc
import numpy as np

from bench import soak
from bench.workloads import MediaSpec, WORKLOADS, grpc_request
from omni.v1 import omni_pb2_grpc

DEADLINE_S = 10.0  # each overload request's own deadline, as a client with a patience would set
MEDIA = MediaSpec(distinct=8)


async def one(stub, req, timeout: float) -> dict:
    t0 = time.perf_counter()
    out = {"ttft": None, "ttfa": None, "status": "OK"}
    try:
        async for r in stub.Generate(req, timeout=timeout):
            kind = r.WhichOneof("event")
            if kind == "text" and out["ttft"] is None and r.text.token_ids:
                out["ttft"] = time.perf_counter() - t0
            elif kind == "audio" and out["ttfa"] is None:
                out["ttfa"] = time.perf_counter() - t0
    except grpc.aio.AioRpcError as e:
        out["status"], out["details"] = e.code().name, e.details()
    out["latency"] = time.perf_counter() - t0
    return out


async def closed_loop(address: str, workload: str, concurrency: int, seconds: float) -> list[dict]:
    """`concurrency` requests always in flight for `seconds`."""
    w, results, stop = WORKLOADS[workload], [], time.perf_counter() + seconds
    async with grpc.aio.insecure_channel(address) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)

        async def client(c: int):
            i = c
            while time.perf_counter() < stop:
                results.append(await one(stub, grpc_request(w, i, MEDIA), 300))
                i += concurrency

        await asyncio.gather(*(client(c) for c in range(concurrency)))
    return results


async def single(address: str, workload: str, index: int = 0) -> dict:
    async with grpc.aio.insecure_channel(address) as ch:
        return await one(omni_pb2_grpc.OmniStub(ch), grpc_request(WORKLOADS[workload], index, MEDIA), 60)


async def open_loop(address: str, workload: str, rate: float, seconds: float) -> list[dict]:
    """Poisson arrivals at `rate` a second for `seconds`, each with its deadline: what an overloaded service meets."""
    w, tasks, rng = WORKLOADS[workload], [], random.Random(0)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        t_end, i = time.perf_counter() + seconds, 0
        while time.perf_counter() < t_end:
            tasks.append(asyncio.ensure_future(one(stub, grpc_request(w, i, MEDIA), DEADLINE_S)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def pct(values, q) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summary(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["status"] == "OK"]
    refused = [r for r in results if r["status"] == "RESOURCE_EXHAUSTED"]
    statuses, errors = {}, {}
    for r in results:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
        if r["status"] not in ("OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"):  # the unexpected ones, in words
            kept = errors.setdefault(r["status"], [])
            if r.get("details") not in kept and len(kept) < 3:
                kept.append(r.get("details"))
    return {"offered": len(results), "statuses": statuses, "errors": errors, "goodput_rps": len(ok) / seconds,
            "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p99": pct([r["ttft"] for r in ok], 99),
            "ttfa_p50": pct([r["ttfa"] for r in ok], 50), "ttfa_p99": pct([r["ttfa"] for r in ok], 99),
            "latency_p99": pct([r["latency"] for r in ok], 99),
            "refusal_p50": pct([r["latency"] for r in refused], 50), "refusal_p99": pct([r["latency"] for r in refused], 99)}


async def recovery(address: str, workload: str, unloaded_s: float, limit_s: float = 60.0) -> float | None:
    """Seconds after the load stops until a request is served within 1.5x of its unloaded latency."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        r = await single(address, workload)
        if r["status"] == "OK" and r["latency"] <= 1.5 * unloaded_s:
            return time.perf_counter() - t0
        await asyncio.sleep(0.2)
    return None


def kill_and_recover(mesh, workload: str, limit_s: float = 120.0) -> dict:
    """Each stage kind's first process killed (SIGKILL): seconds until it serves again, and until a request that needs
    it is answered."""
    from services.runtime.probe import stage_serving

    out = {}
    for name, stage, i in mesh.processes():
        if i != 0 or stage in mesh.cfg.HTTP_STAGES:
            continue
        address = mesh.cfg.replicas(stage)[i].address
        mesh.procs[name].send_signal(signal.SIGKILL)  # the mesh's supervisor starts it again
        t0 = time.perf_counter()
        serving = answered = None
        while time.perf_counter() - t0 < limit_s and answered is None:
            if serving is None and stage_serving(stage, address, timeout=0.5, security=mesh.cfg.security):
                serving = time.perf_counter() - t0
            if serving is not None:
                if asyncio.run(single(mesh.gateway_address, workload))["status"] == "OK":
                    answered = time.perf_counter() - t0
            time.sleep(0.1)
        out[stage] = {"serving_s": serving, "answered_s": answered}
    return out


def main() -> None:
    from services.launch import Mesh
    from services.runtime.config import MeshConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="t2t,t2s")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop requests in flight, for capacity")
    parser.add_argument("--seconds", type=float, default=30.0, help="each capacity and overload run")
    parser.add_argument("--overload", type=float, default=5.0, help="the offered rate, in multiples of capacity")
    parser.add_argument("--soak-minutes", type=float, default=2.0)
    parser.add_argument("--phases", default="overload,kill,soak", help="which of overload, kill and soak to run")
    parser.add_argument("--log-dir", default=None, help="the stages' logs (default .cache/logs)")
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    if phases - {"overload", "kill", "soak"}:
        raise SystemExit(f"--phases: unknown {sorted(phases - {'overload', 'kill', 'soak'})}; known: overload, kill, soak")
    out: dict = {"config": args.config, "overload": args.overload, "deadline_s": DEADLINE_S, "workloads": {}}
    stages = tuple(s for s in MeshConfig.STAGES if s not in MeshConfig.HTTP_STAGES)
    with Mesh(args.config, args.log_dir, stages=stages, supervise=True) as mesh:
        for name in args.workloads.split(",") if "overload" in phases else ():
            unloaded = summary(asyncio.run(closed_loop(mesh.gateway_address, name, 1, args.seconds / 3)), args.seconds / 3)
            capacity = summary(asyncio.run(closed_loop(mesh.gateway_address, name, args.concurrency, args.seconds)), args.seconds)
            rate = args.overload * capacity["goodput_rps"]
            over = summary(asyncio.run(open_loop(mesh.gateway_address, name, rate, args.seconds)), args.seconds)
            over["recovery_s"] = asyncio.run(recovery(mesh.gateway_address, name, unloaded["latency_p99"] or 1.0))
            out["workloads"][name] = {"unloaded": unloaded, "capacity": capacity, "offered_rps": rate, "overload": over}
            print(name, json.dumps(out["workloads"][name]))
        if "kill" in phases:
            out["kill"] = kill_and_recover(mesh, args.workloads.split(",")[-1])
            print("kill", json.dumps(out["kill"]))
        if "soak" in phases and args.soak_minutes > 0:
            s = soak.run(mesh.gateway_address, {n: p.pid for n, p in mesh.procs.items()}, 60 + args.soak_minutes * 60)
            out["soak"] = {"minutes": args.soak_minutes, "served": s.ok, "failures": s.failures[:20],
                           "slopes_per_min": soak.slopes(s, 60)}
            print("soak", json.dumps(out["soak"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
