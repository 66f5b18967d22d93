"""A soak: mixed traffic through the public API for a while (text and speech out, images and clips in, streams the
client leaves early, bad requests), sampling every stage process's memory (with its children), open files and the
mesh's shared memory; the slopes after a warm-up say whether anything leaks.

    python -m bench.soak --config configs/local.yaml --minutes 2 --out .cache/soak.json   (starts the mesh itself)
"""

import argparse
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.workloads import clip_wav, image_png
from omni.v1 import omni_pb2, omni_pb2_grpc

KINDS = ("text", "speech", "image", "audio", "leave", "bad")


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            pass
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its children (a preprocess stage's decoder workers)."""
    total = 0
    for p in descendants(pid):
        try:
            total += _status(p, "VmRSS")
        except FileNotFoundError:
            pass
    return total


def open_files(pid: int) -> int:
    total = 0
    for p in descendants(pid):
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except FileNotFoundError:
            pass
    return total


def shm_bytes() -> int:
    """What the mesh's /dev/shm pools hold (they are sparse: blocks, not sizes)."""
    total = 0
    for f in Path("/dev/shm").glob("omni-*"):
        try:
            total += f.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def slope_per_min(t: list[float], v: list[float]) -> float:
    return float(np.polyfit(np.asarray(t) / 60.0, np.asarray(v, dtype=float), 1)[0]) if len(t) > 2 else 0.0


def request(kind: str, i: int) -> omni_pb2.GenerateRequest:
    parts = {"image": [omni_pb2.Part(image=omni_pb2.Image(data=image_png(i % 8, 96)))],
             "audio": [omni_pb2.Part(audio=omni_pb2.Audio(file=clip_wav(i % 8, 1.0)))],
             "bad": [omni_pb2.Part(image=omni_pb2.Image(data=b"\x89PNG\r\n\x1a\n not a picture"))]}.get(kind, [])
    speech = kind in ("speech", "leave")
    req = omni_pb2.GenerateRequest(
        messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=[*parts, omni_pb2.Part(text=f"soak {kind} {i}")])],
        output_modalities=[omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if speech else []))
    req.sampling.max_tokens, req.sampling.seed = 24 if kind == "leave" else 8, i + 1
    if speech:
        req.talker_sampling.max_tokens, req.talker_sampling.ignore_eos = 60 if kind == "leave" else 16, True
    return req


@dataclass
class Soak:
    ok: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    failures: list[str] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)


def _client(address: str, stop: threading.Event, worker: int, soak: Soak, lock: threading.Lock) -> None:
    with grpc.insecure_channel(address) as ch:
        stub, i = omni_pb2_grpc.OmniStub(ch), worker
        while not stop.is_set():
            kind = KINDS[i % len(KINDS)]
            try:
                call = stub.Generate(request(kind, i), timeout=60)
                for n, _ in enumerate(call):
                    if kind == "leave" and n == 2:
                        call.cancel()  # the client goes away mid-stream
                        break
                good = kind != "bad"
            except grpc.RpcError as e:
                good = kind == "bad" and e.code() == grpc.StatusCode.INVALID_ARGUMENT
                if not good and not (kind == "leave" and e.code() == grpc.StatusCode.CANCELLED):
                    with lock:
                        soak.failures.append(f"{kind}: {e.code().name} {e.details()}")
            with lock:
                soak.ok[kind] += good
            i += 7  # workers' kinds drift apart, so every mix of kinds shares steps


def warm(address: str, clients: int, seconds: float = 300.0) -> None:
    """Every batch the soak can make, made once first: what a stage keeps for a new batch size (its buffers, plans
    and graphs) is allocated here, and not read later as growth. Bounded by `seconds` in all."""
    deadline = time.monotonic() + seconds
    with grpc.insecure_channel(address) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        for kind in ("speech", "image", "audio", "text"):
            for n in range(1, clients + 1):
                timeout = min(60.0, deadline - time.monotonic())
                if timeout <= 0:
                    raise TimeoutError(f"the soak's warm-up took over {seconds:.0f} s (at {kind} x {n})")
                calls = [stub.Generate(request(kind, i), timeout=timeout) for i in range(n)]
                for call in calls:
                    for _ in call:
                        pass


def run(address: str, pids: dict[str, int], seconds: float, clients: int = 4, every_s: float = 2.0) -> Soak:
    soak, lock, stop = Soak(), threading.Lock(), threading.Event()
    warm(address, clients)
    threads = [threading.Thread(target=_client, args=(address, stop, w, soak, lock), daemon=True) for w in range(clients)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        soak.samples.append({"t": time.monotonic() - t0, "shm": shm_bytes(),
                             **{f"rss:{n}": tree_rss(p) for n, p in pids.items()},
                             **{f"fds:{n}": open_files(p) for n, p in pids.items()}})
        time.sleep(every_s)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return soak


def slopes(soak: Soak, warmup_s: float) -> dict[str, float]:
    """Per sampled series, its change per minute after `warmup_s` (bytes or files)."""
    kept = [s for s in soak.samples if s["t"] >= warmup_s]
    return {k: slope_per_min([s["t"] for s in kept], [s[k] for s in kept]) for k in kept[0] if k != "t"} if kept else {}


def main() -> None:
    from services.launch import Mesh
    from services.runtime.config import MeshConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    grpc_stages = tuple(s for s in MeshConfig.STAGES if s not in MeshConfig.HTTP_STAGES)
    with Mesh(args.config, stages=grpc_stages) as mesh:
        pids = {name: p.pid for name, p in mesh.procs.items()}
        soak = run(mesh.gateway_address, pids, args.warmup_minutes * 60 + args.minutes * 60, args.clients)
    result = {"config": args.config, "minutes": args.minutes, "warmup_minutes": args.warmup_minutes, "clients": args.clients,
              "served": soak.ok, "failures": soak.failures[:50], "slopes_per_min": slopes(soak, args.warmup_minutes * 60),
              "samples": soak.samples}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for k, v in result["slopes_per_min"].items():
        print(f"{k:>24}: {v / (1 << 20) if not k.startswith('fds') else v:+.3f} {'MB' if not k.startswith('fds') else 'files'}/min")
    print("served:", soak.ok, "failures:", len(soak.failures))


if __name__ == "__main__":
    main()
