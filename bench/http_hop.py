"""The HTTP hop alone: an api process in front of a stand-in gateway that answers at once, so what is measured is the
api's own cost: the time to the first event (HTTP through httpx, against gRPC straight to the stand-in) and the api
process's CPU per streamed token.

    python -m bench.http_hop --out bench/results/http-hop-cpu-COMMIT.json
"""

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import yaml

from bench import results
from omni.v1 import omni_pb2, omni_pb2_grpc
from services.runtime.config import REPO_ROOT


class Instant(omni_pb2_grpc.OmniServicer):
    """Streams `tokens` one-token deltas as fast as it can (the request's max_tokens), then Finished."""

    def GetModelInfo(self, request, context):
        return omni_pb2.ModelInfo(model="stand-in", limits=omni_pb2.Limits(max_request_bytes=1 << 20))

    def Generate(self, request, context):
        for i in range(request.sampling.max_tokens or 1):
            yield omni_pb2.GenerateResponse(text=omni_pb2.TextDelta(text="ab", token_ids=[i]))
        yield omni_pb2.GenerateResponse(finished=omni_pb2.Finished(reason=omni_pb2.FINISH_REASON_LENGTH))


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(api: str, gateway: str, pid: int, requests: int, tokens: int, concurrency: int) -> dict:
    body = {"model": "stand-in", "messages": [{"role": "user", "content": "x" * 100}], "stream": True, "return_token_ids": True}
    grpc_req = omni_pb2.GenerateRequest(messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=[omni_pb2.Part(text="x" * 100)])])
    out = {}
    async with httpx.AsyncClient(timeout=60) as client, grpc.aio.insecure_channel(gateway) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)

        async def http_first() -> float:
            t0 = time.perf_counter()
            async with client.stream("POST", api + "/v1/chat/completions", json={**body, "max_tokens": 1}) as r:
                async for piece in r.aiter_raw():
                    if b"token_ids" in piece:
                        return time.perf_counter() - t0
            raise RuntimeError("no token came")

        async def grpc_first() -> float:
            grpc_req.sampling.max_tokens = 1
            t0 = time.perf_counter()
            async for _ in stub.Generate(grpc_req):
                return time.perf_counter() - t0

        for door, first in (("http", http_first), ("grpc", grpc_first)):
            await first()
            laps = sorted([await first() for _ in range(requests)])
            out[f"first_event_{door}_p50_ms"] = 1e3 * statistics.median(laps)
            out[f"first_event_{door}_p90_ms"] = 1e3 * laps[int(0.9 * len(laps))]

        async def stream() -> int:
            n = 0
            async with client.stream("POST", api + "/v1/chat/completions", json={**body, "max_tokens": tokens}) as r:
                async for piece in r.aiter_raw():
                    n += piece.count(b"token_ids")
            return n

        cpu0, t0 = _cpu_s(pid), time.perf_counter()
        n = sum(await asyncio.gather(*[stream() for _ in range(concurrency)]))
        wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    out.update(streamed_tokens=n, concurrency=concurrency, wall_s=wall, api_cpu_s=cpu, api_cpu_us_per_token=1e6 * cpu / n,
               tokens_per_s=n / wall)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--requests", type=int, default=200, help="first-event laps per door")
    p.add_argument("--tokens", type=int, default=2000, help="tokens per streamed request")
    p.add_argument("--concurrency", type=int, default=8, help="streams at once for the CPU per token")
    args = p.parse_args(argv)
    server = grpc.server(futures.ThreadPoolExecutor(8))
    omni_pb2_grpc.add_OmniServicer_to_server(Instant(), server)
    gateway = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    port = _port()
    cfg = {"model": {"load_format": "random"}, "gateway": {"replicas": [{"port": int(gateway.rsplit(':', 1)[1]), "metrics_port": _port()}]},
           **{s: {"replicas": [{"port": _port(), "metrics_port": _port()}]} for s in ("preprocess", "encoder", "thinker")},
           "api": {"replicas": [{"port": port, "metrics_port": _port()}]}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(cfg, f)
        proc = subprocess.Popen([sys.executable, "-m", "services.api", "--config", f.name], cwd=REPO_ROOT,
                                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        try:
            from services.runtime.probe import is_healthy

            while not is_healthy(f"127.0.0.1:{port}", 1.0):
                time.sleep(0.2)
            figures = asyncio.run(measure(f"http://127.0.0.1:{port}", gateway, proc.pid, args.requests, args.tokens,
                                          args.concurrency))
        finally:
            proc.terminate()
            proc.wait()
            server.stop(0)
    run = {"command": "python -m bench.http_hop " + shlex.join(sys.argv[1:] if argv is None else argv), "args": vars(args),
           "load_average": os.getloadavg()}  # the host's other work: this measures the api on a shared host
    result = results.new_result("stages", {"path": "", "content": cfg, "overrides": []}, {}, run)
    result["machine"] = results.machine()
    result["cells"] = [{"stage": "api", "mode": "hop", "status": "ok", **figures}]
    results.write(result, args.out)
    print(figures)
    return result


if __name__ == "__main__":
    main()
