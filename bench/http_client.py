"""Closed-loop load over the OpenAI-compatible HTTP API (services/api): the gRPC workloads' requests written as chat
completion bodies, streamed (SSE), timed as bench.loadgen times the gRPC stream, so both doors measure alike.

Each request asks for its token ids back (`return_token_ids`), so tokens are counted exactly as over gRPC, and for
its usage (`stream_options.include_usage`); speech comes as PCM16 (`audio.format: pcm16`), the gRPC workloads' own.
"""

import asyncio
import base64
import json
import time

import httpx

from bench.loadgen import LoopResult, MeshClient
from bench.records import RequestRecord
from omni.v1 import omni_pb2

ROLES = {omni_pb2.ROLE_SYSTEM: "system", omni_pb2.ROLE_USER: "user", omni_pb2.ROLE_ASSISTANT: "assistant"}
SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed", "repetition_penalty")


def _part(p: omni_pb2.Part) -> dict:
    kind = p.WhichOneof("content")
    if kind == "text":
        return {"type": "text", "text": p.text}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p.image.data).decode()}}
    if kind == "audio":
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(p.audio.file).decode(), "format": "wav"}}
    if kind == "video" and p.video.file:
        return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(p.video.file).decode(),
                                                   "use_audio_in_video": p.video.use_audio_in_video}}
    raise ValueError(f"no chat-completions form for a {kind} part")


def _sampling(s: omni_pb2.SamplingParams) -> dict:
    out = {name: getattr(s, name) for name in SAMPLING if s.HasField(name)}
    return out | ({"ignore_eos": True} if s.ignore_eos else {})


def chat_body(req: omni_pb2.GenerateRequest, model: str, default_voice: str) -> dict:
    """The chat completion body that the api process translates back into `req` (OpenAI's API needs a voice named)."""
    body = {"model": model, "messages": [{"role": ROLES[m.role], "content": [_part(p) for p in m.parts]} for m in req.messages],
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, **_sampling(req.sampling)}
    if omni_pb2.MODALITY_AUDIO in req.output_modalities:
        body.update(modalities=["text", "audio"], audio={"voice": req.voice or default_voice, "format": "pcm16"},
                    talker=_sampling(req.talker_sampling))
    return body


def _b64_bytes(data: str) -> int:
    return len(data) * 3 // 4 - data.count("=", max(0, len(data) - 2))


class HttpClient:
    """One connection pool to the api process; the same closed loop as bench.loadgen.MeshClient's."""

    def __init__(self, url: str, default_voice: str, timeout: float = 900.0):
        self.url, self.voice, self.model, self.messages = url.rstrip("/"), default_voice, "", 0
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def model_info(self) -> str:
        reply = await self.http.get(self.url + "/v1/models")
        reply.raise_for_status()
        self.model = reply.json()["data"][0]["id"]
        return self.model

    async def close(self) -> None:
        await self.http.aclose()

    async def closed_loop(self, requests, concurrency: int, deadline: float | None = None) -> LoopResult:
        if not self.model:
            await self.model_info()
        bodies = [(i, json.dumps(chat_body(r, self.model, self.voice)).encode()) for i, r in requests]  # before the clock starts
        return await MeshClient.closed_loop(self, bodies, concurrency, deadline)

    async def one(self, index: int, body: bytes) -> RequestRecord:
        rec = RequestRecord(index=index, start=time.perf_counter())
        last_text = 0.0
        try:
            async with self.http.stream("POST", self.url + "/v1/chat/completions", content=body,
                                        headers={"content-type": "application/json"}) as reply:
                if reply.status_code != 200:
                    rec.error, rec.detail = f"HTTP {reply.status_code}", (await reply.aread()).decode(errors="replace")[:500]
                    return rec
                async for data in _events(reply):
                    now = time.perf_counter()
                    self.messages += 1
                    if data == b"[DONE]":
                        rec.finished = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec.error, rec.detail = "STREAM_ERROR", event["error"]["message"][:500]
                        break
                    if not event["choices"]:  # the usage, last
                        u = event["usage"]
                        rec.prompt_tokens = u["prompt_tokens"]
                        rec.usage_tokens = u["completion_tokens_details"]["text_tokens"]
                        rec.audio_frames = u["completion_tokens_details"]["audio_tokens"]
                        continue
                    choice = event["choices"][0]
                    if n := len(choice.get("token_ids") or ()):
                        if rec.ttft is None:
                            rec.ttft = now - rec.start
                        else:
                            rec.itl.append((now - last_text) / n)
                        last_text = now
                        rec.text_tokens += n
                        rec.text_deltas += 1
                    audio = choice["delta"].get("audio")
                    if audio and audio.get("data"):
                        if rec.ttfa is None:
                            rec.ttfa = now - rec.start
                        rec.audio_samples += _b64_bytes(audio["data"]) // 2  # PCM16 mono
                        rec.audio_chunks += 1
        except httpx.HTTPError as e:
            rec.error, rec.detail = type(e).__name__, str(e)[:500]
        except asyncio.CancelledError:
            rec.error, rec.detail = "CANCELLED", "the run's time ran out"
            raise
        finally:
            rec.end = time.perf_counter()
        if not rec.finished and not rec.error:
            rec.error, rec.detail = "UNFINISHED", "the stream ended without [DONE]"
        return rec


async def _events(reply: httpx.Response):
    """The data of each Server-Sent Event as it arrives, split on bytes (lighter than decoded lines: the client's CPU
    is the machine's too)."""
    buf = b""
    async for piece in reply.aiter_raw():
        buf += piece
        *events, buf = buf.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: "):
                yield event[6:]
