"""POST /v1/audio/speech: text in, speech out, from the same mesh (the model reads the input out), as the audio's own
bytes streamed (stream_format "audio") or as speech.audio.delta events (stream_format "sse")."""

import base64
import json

import grpc
from starlette.responses import StreamingResponse

from omni.v1 import omni_pb2
from services.api import metrics
from services.api.errors import from_grpc
from services.api.formats import MEDIA_TYPES
from services.api.schema import SpeechRequest
from services.api.upstream import next_event


async def first_audio(call: grpc.aio.UnaryStreamCall) -> omni_pb2.GenerateResponse | None:
    """The first response carrying audio (or the Finished one, or None): what the reply's headers wait for."""
    while (r := await next_event(call)) is not None and not (r.HasField("audio") or r.HasField("finished")):
        pass
    return r


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _responses(first, call: grpc.aio.UnaryStreamCall):
    r = first
    while r is not None:
        yield r
        r = await call.read()
        r = None if r is grpc.aio.EOF else r


async def _audio_bytes(first, call, fmt: str):
    try:
        async for r in _responses(first, call):
            if r.HasField("audio") and r.audio.data:
                metrics.AUDIO_BYTES.labels(fmt).inc(len(r.audio.data))
                yield r.audio.data
    except grpc.aio.AioRpcError:
        pass  # the body is audio: a failure midway can only end it short
    finally:
        call.cancel()


async def _audio_events(first, call, fmt: str):
    try:
        async for r in _responses(first, call):
            if r.HasField("audio") and r.audio.data:
                metrics.AUDIO_BYTES.labels(fmt).inc(len(r.audio.data))
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(r.audio.data).decode()})
            elif r.HasField("finished"):
                u = r.finished.usage
                output = u.completion_tokens + u.audio_frames
                yield _sse({"type": "speech.audio.done", "usage": {
                    "input_tokens": u.prompt_tokens, "output_tokens": output, "total_tokens": u.prompt_tokens + output}})
    except grpc.aio.AioRpcError as e:
        yield _sse(from_grpc(e).body())
    finally:
        call.cancel()


def reply(req: SpeechRequest, first, call: grpc.aio.UnaryStreamCall) -> StreamingResponse:
    if req.stream_format == "sse":
        return StreamingResponse(_audio_events(first, call, req.response_format), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    return StreamingResponse(_audio_bytes(first, call, req.response_format), media_type=MEDIA_TYPES[req.response_format])
