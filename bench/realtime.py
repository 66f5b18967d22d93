"""Realtime sessions over `Omni/Converse`, as a voice client holds them: N sessions at once, each speaking a turn of
speech at the pace of a microphone, then silence until the server's turn detection commits it, then listening to
the spoken answer; after its turns, one barge-in: speech sent over an answer.

    python -m bench.realtime --config configs/bench-1xh200-mesh.yaml --launch --sessions 1,8,32 --out FILE

A cell (one session count): `first_audio_*`, from the `committed` event to the answer's first audio chunk;
`barge_in_*`, from the first interrupting chunk sent to the interrupted answer's last audio chunk received (the
detector's own `speech_ms` included; 0 where the last chunk came before it); `stopped_*`, from the detector's
`speech_started` to the interrupted turn's `done`; the turns each session completed and its failures. The answer
spoken over is `--barge-frames` long, so it is still being made when the user speaks.
"""

import argparse
import asyncio
import time

import grpc
import numpy as np

from bench.results import new_result, write
from bench.workloads import voiced
from omni.v1 import omni_pb2, omni_pb2_grpc

RATE = 24000  # the client's PCM16, as OpenAI's Realtime protocol sends it
CHUNK_S = 0.1  # a microphone's packet


def settings(tokens: int, frames: int) -> omni_pb2.SessionSettings:
    s = omni_pb2.SessionSettings(output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
                                 input_sample_rate=RATE, turn_detection=omni_pb2.TurnDetection(enabled=True))
    s.sampling.max_tokens, s.talker_sampling.max_tokens = tokens, frames
    s.sampling.ignore_eos = s.talker_sampling.ignore_eos = True  # answers of the asked length
    return s


class Session:
    """One Converse call: events read on a task, each kind's arrival times kept by turn."""

    def __init__(self, stub, index: int):
        self.call, self.index = stub.Converse(), index
        self.events: asyncio.Queue = asyncio.Queue()
        self.audio_at: dict[str, list[float]] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self):
        async for r in self.call:
            now = time.perf_counter()
            kind = r.WhichOneof("event")
            if kind == "audio":
                self.audio_at.setdefault(r.turn_id, []).append(now)
            await self.events.put((kind, r, now))

    async def until(self, kind: str, timeout: float) -> tuple:
        while True:
            k, r, at = await asyncio.wait_for(self.events.get(), timeout)
            if k == "error":
                raise RuntimeError(f"session {self.index}: {r.error.code}: {r.error.message}")
            if k == kind:
                return r, at

    async def speak(self, pcm: np.ndarray) -> float:
        """Sends `pcm` in microphone packets at its own pace; when its first packet went."""
        step, first = int(CHUNK_S * RATE), None
        for i in range(0, len(pcm), step):
            t0 = time.perf_counter()
            first = first or t0
            await self.call.write(omni_pb2.ConverseRequest(audio=pcm[i:i + step].tobytes()))
            await asyncio.sleep(max(0.0, CHUNK_S - (time.perf_counter() - t0)))
        return first


async def one(stub, index: int, args) -> dict:
    out = {"first_audio": [], "barge_in": None, "stopped": None, "turns": 0, "failures": []}
    s = Session(stub, index)
    speech = voiced(args.speech_seconds, RATE, seed=index)
    silence = np.zeros(int(args.silence_seconds * RATE), "<i2")
    timeout = args.turn_timeout
    try:
        await s.until("session", timeout)
        await s.call.write(omni_pb2.ConverseRequest(settings=settings(args.tokens, args.frames)))
        await s.until("session", timeout)
        for _ in range(args.turns):
            await s.speak(speech)
            speaking = asyncio.ensure_future(s.speak(silence))
            _, committed = await s.until("committed", timeout)
            r, first = await s.until("audio", timeout)
            await speaking
            out["first_audio"].append(first - committed)
            done, _ = await s.until("done", timeout)
            out["turns"] += 1
        # The answer spoken over is long: still being made when the detector hears the user
        await s.call.write(omni_pb2.ConverseRequest(settings=settings(args.tokens, args.barge_frames)))
        await s.until("session", timeout)
        await s.speak(speech)
        speaking = asyncio.ensure_future(s.speak(silence))
        await s.until("committed", timeout)
        r, _ = await s.until("audio", timeout)
        await speaking
        await asyncio.sleep(args.barge_after)
        barge = asyncio.ensure_future(s.speak(speech))  # over the answer
        _, started = await s.until("speech_started", timeout)
        done, done_at = await s.until("done", timeout)
        sent = await barge
        heard = s.audio_at.get(r.turn_id, [])
        if done.done.status == omni_pb2.TURN_STATUS_INTERRUPTED and heard:
            out["barge_in"] = max(heard[-1] - sent, 0.0)
            out["stopped"] = done_at - started
    except (grpc.aio.AioRpcError, asyncio.TimeoutError, RuntimeError) as e:
        out["failures"].append(f"{type(e).__name__}: {e}")
    finally:
        s.call.cancel()
        s.reader.cancel()
    return out


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def cell(address: str, n: int, args) -> dict:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = omni_pb2_grpc.OmniStub(ch)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(stub, i, args) for i in range(n)))
    first = [x for r in results for x in r["first_audio"]]
    barge = [r["barge_in"] for r in results if r["barge_in"] is not None]
    stopped = [r["stopped"] for r in results if r["stopped"] is not None]
    return {"sessions": n, "seconds": time.perf_counter() - t0, "turns": sum(r["turns"] for r in results),
            "first_audio_p50": pct(first, 50), "first_audio_p99": pct(first, 99),
            "barge_in_p50": pct(barge, 50), "barge_in_p99": pct(barge, 99), "barge_ins": len(barge),
            "stopped_p50": pct(stopped, 50), "stopped_p99": pct(stopped, 99),
            "failures": [f for r in results for f in r["failures"]][:20]}


def main(argv: list[str] | None = None) -> None:
    from services.launch import Mesh
    from services.runtime.config import MeshConfig, load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--launch", action="store_true", help="start the mesh of --config (and stop it at the end)")
    p.add_argument("--sessions", default="1,8,32")
    p.add_argument("--turns", type=int, default=3, help="answered turns a session speaks before its barge-in")
    p.add_argument("--speech-seconds", type=float, default=3.0)
    p.add_argument("--silence-seconds", type=float, default=1.0, help="after each turn: the detector commits in it")
    p.add_argument("--tokens", type=int, default=64, help="an answer's text tokens")
    p.add_argument("--frames", type=int, default=63, help="an answer's codec frames (12.5 a second: 5 s)")
    p.add_argument("--barge-after", type=float, default=0.5, help="seconds into an answer's audio the user speaks")
    p.add_argument("--barge-frames", type=int, default=750, help="the codec frames of the answer spoken over (60 s)")
    p.add_argument("--turn-timeout", type=float, default=120.0)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    result = new_result("mesh", {"config": args.config}, {"name": cfg.model.name},
                        {k: v for k, v in vars(args).items() if k not in ("out",)})
    result["cells"] = []
    stages = tuple(s for s in MeshConfig.STAGES if s not in MeshConfig.HTTP_STAGES)
    mesh = Mesh(args.config, args.log_dir, stages=stages) if args.launch else None
    try:
        if mesh is not None:
            mesh.start()
        address = mesh.gateway_address if mesh is not None else cfg.gateway.replicas[0].address
        for n in [int(x) for x in args.sessions.split(",")]:
            c = asyncio.run(cell(address, n, args))
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items() if k != "failures"),
                  f"failures={len(c['failures'])}", flush=True)
            result["cells"].append(c)
            write(result, args.out)
    finally:
        if mesh is not None:
            mesh.stop()


if __name__ == "__main__":
    main()
