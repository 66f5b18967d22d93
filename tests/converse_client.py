"""A Converse session from tests: events written as the test goes, the server's read into per-kind lists, and the
stages' load read over their Load service to see what each holds."""

import asyncio
import time

import grpc
import numpy as np

from omni.stage.v1 import load_pb2, load_pb2_grpc
from omni.v1 import omni_pb2, omni_pb2_grpc
from bench.workloads import voiced

IN_RATE = 24000
CHUNK_S = 0.1


def settings(speech: bool = True, tokens: int = 6, frames: int = 10, vad: bool = False, long: bool = False,
             rate: int = IN_RATE, **extra) -> omni_pb2.SessionSettings:
    s = omni_pb2.SessionSettings(
        output_modalities=[omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if speech else []),
        input_sample_rate=rate, turn_detection=omni_pb2.TurnDetection(enabled=vad), **extra)
    s.sampling.temperature = s.talker_sampling.temperature = 0
    s.sampling.max_tokens, s.talker_sampling.max_tokens = tokens, frames
    s.sampling.ignore_eos = s.talker_sampling.ignore_eos = long
    return s


def speech_clip(seconds: float = 1.0, seed: int = 0, rate: int = IN_RATE, silence_s: float = 0.0) -> bytes:
    return np.concatenate([voiced(seconds, rate, seed=seed), np.zeros(int(silence_s * rate), "<i2")]).tobytes()


class Conversation:
    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.call = omni_pb2_grpc.OmniStub(self.channel).Converse()
        self.events: list[omni_pb2.ConverseResponse] = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.call.cancel()
        await self.channel.close()

    async def start(self, s: omni_pb2.SessionSettings | None = None) -> omni_pb2.SessionInfo:
        """The session as it starts, then as `s` leaves it."""
        info = (await self.until("session"))[-1].session
        if s is not None:
            await self.send(settings=s)
            info = (await self.until("session"))[-1].session
        return info

    async def send(self, **event) -> None:
        await self.call.write(omni_pb2.ConverseRequest(**event))

    async def audio(self, pcm: bytes, rate: int = IN_RATE) -> None:
        step = int(CHUNK_S * rate) * 2
        for i in range(0, len(pcm), step):
            await self.send(audio=pcm[i:i + step])

    async def until(self, kind: str, timeout: float = 60.0) -> list[omni_pb2.ConverseResponse]:
        """Events up to and including the next one of `kind`."""
        out = []
        async with asyncio.timeout(timeout):
            while True:
                resp = await self.call.read()
                assert resp is not grpc.aio.EOF, f"the session ended before a {kind} event: {[e.WhichOneof('event') for e in out]}"
                self.events.append(resp)
                out.append(resp)
                if resp.WhichOneof("event") == kind:
                    return out

    async def turn(self, timeout: float = 60.0) -> "Answer":
        return Answer(await self.until("done", timeout))


class Answer:
    """One turn's events, read to its TurnDone."""

    def __init__(self, events):
        self.events = events
        self.kinds = [e.WhichOneof("event") for e in events]
        self.done = events[-1].done
        self.turn_id = events[-1].turn_id
        mine = [e for e in events if e.turn_id == self.turn_id]
        self.token_ids = [t for e in mine if e.HasField("text") for t in e.text.token_ids]
        self.text = "".join(e.text.text for e in mine if e.HasField("text"))
        self.audio = [e.audio for e in mine if e.HasField("audio")]
        self.frames = sum(len(a.codec_codes) // max(1, a.num_codebooks) for a in self.audio)
        self.errors = [e.error for e in events if e.HasField("error")]

    @property
    def samples(self) -> int:
        return sum(len(a.data) // 2 for a in self.audio)


class Load:
    """Each stage's load, read over its Load service."""

    def __init__(self, mesh):
        self.channels = {}
        for stage in ("preprocess", "encoder", "thinker", "talker"):
            for i, r in enumerate(mesh.cfg.replicas(stage)):
                self.channels[f"{stage}{i}"] = grpc.aio.insecure_channel(r.address)
        self.stubs = {k: load_pb2_grpc.LoadStub(c) for k, c in self.channels.items()}

    async def held(self) -> dict[str, tuple[int, int]]:
        """(RPCs in flight, engine sequences) per stage."""
        reports = await asyncio.gather(*(s.Get(load_pb2.LoadRequest(), timeout=5) for s in self.stubs.values()))
        return {k: (r.in_flight, r.active) for k, r in zip(self.stubs, reports)}

    async def busy(self, *stages: str) -> bool:
        held = await self.held()
        return all(held[s][1] >= 1 for s in stages)

    async def freed_within(self, t0: float, limit: float = 5.0) -> tuple[float, dict]:
        """Seconds from `t0` (perf_counter) until no stage holds anything, and what they held last."""
        while True:
            held = await self.held()
            now = time.perf_counter()
            if all(v == (0, 0) for v in held.values()) or now - t0 > limit:
                return now - t0, held

    async def close(self) -> None:
        for c in self.channels.values():
            await c.close()
