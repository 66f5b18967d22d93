"""POST /v1/chat/completions: the gateway's stream as one chat.completion, or as chat.completion.chunk events (SSE)
whose deltas carry the text and the audio as they come, one choice for both."""

import base64
import json
import secrets
import time

import grpc
from starlette.responses import JSONResponse, Response, StreamingResponse

from omni.v1 import omni_pb2
from services.api import metrics
from services.api.audio_store import AudioStore
from services.api.errors import from_grpc
from services.api.schema import ChatRequest
from services.api.upstream import next_event

FINISH = {omni_pb2.FINISH_REASON_STOP: "stop", omni_pb2.FINISH_REASON_STOP_STRING: "stop",
          omni_pb2.FINISH_REASON_LENGTH: "length"}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def usage(u: omni_pb2.Usage) -> dict:
    """OpenAI's usage: audio tokens (the talker's codec frames) counted within the completion, as OpenAI counts its own."""
    completion = u.completion_tokens + u.audio_frames
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion, "total_tokens": u.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"text_tokens": u.completion_tokens, "audio_tokens": u.audio_frames,
                                          "reasoning_tokens": 0, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class Reply:
    """One chat completion being made: what came so far, shaped as OpenAI shapes it."""

    def __init__(self, req: ChatRequest, model: str, store: AudioStore):
        self.id, self.created, self.model, self.store = f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), model, store
        self.format = req.audio.format if req.audio is not None else None
        self.audio_id, self.expires_at = store.new_id() if self.format else (None, None)
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.token_ids = bool(req.return_token_ids)
        self.text: list[str] = []
        self.ids: list[int] = []
        self.audio: list[bytes] = []
        self.finished: omni_pb2.Finished | None = None
        # A text delta's event around its text, laid out once: the per-token path encodes only the text and ids.
        head = _sse(self._chunk_obj({"content": "\0"}))
        self._text_head, self._text_tail = head.split(b'"\\u0000"')
        if self.token_ids:
            self._text_tail = self._text_tail.replace(b'"finish_reason":null', b'"finish_reason":null,"token_ids":[\0]')

    def add(self, r: omni_pb2.GenerateResponse) -> None:
        kind = r.WhichOneof("event")
        if kind == "text":
            self.text.append(r.text.text)
            self.ids += r.text.token_ids
        elif kind == "audio":
            self.audio.append(r.audio.data)
            metrics.AUDIO_BYTES.labels(self.format).inc(len(r.audio.data))
        else:
            self.finished = r.finished
            if self.audio_id:  # a later turn may refer back to this audio by its id
                self.store.put(self.audio_id, "".join(self.text), self.expires_at)

    @property
    def finish_reason(self) -> str:
        return FINISH.get(self.finished.reason, "stop")

    def whole(self) -> dict:
        text = "".join(self.text)
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": [], "audio": None}
        if self.audio_id:
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(b"".join(self.audio)).decode(),
                                "expires_at": self.expires_at, "transcript": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason}
        if self.token_ids:
            choice["token_ids"] = self.ids
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": [choice], "usage": usage(self.finished.usage)}

    def _chunk_obj(self, delta: dict, finish: str | None = None, token_ids: list[int] | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None
        return obj

    def chunk(self, delta: dict, finish: str | None = None, token_ids: list[int] | None = None) -> bytes:
        return _sse(self._chunk_obj(delta, finish, token_ids))

    def text_chunk(self, t: omni_pb2.TextDelta) -> bytes:
        text = json.dumps(t.text, ensure_ascii=False).encode()
        tail = self._text_tail.replace(b"\0", ",".join(map(str, t.token_ids)).encode(), 1) if self.token_ids else self._text_tail
        return self._text_head + text + tail

    def delta(self, r: omni_pb2.GenerateResponse) -> bytes:
        """The SSE event for one response of the gateway's stream ("" when it carries nothing to say)."""
        kind = r.WhichOneof("event")
        if kind == "text":
            if not r.text.text and not self.token_ids:
                return b""
            if self.audio_id:  # what the audio says, where OpenAI's clients read it
                return self.chunk({"content": r.text.text, "audio": {"id": self.audio_id, "transcript": r.text.text}},
                                  token_ids=list(r.text.token_ids) if self.token_ids else None)
            return self.text_chunk(r.text)
        if kind == "audio":
            if not r.audio.data:
                return b""
            return self.chunk({"audio": {"id": self.audio_id, "data": base64.b64encode(r.audio.data).decode()}})
        # The last audio update gives only its expiry, as OpenAI's does.
        out = self.chunk({"audio": {"id": self.audio_id, "expires_at": self.expires_at}}) if self.audio_id else b""
        out += self.chunk({}, self.finish_reason)
        if self.include_usage:
            out += _sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                         "system_fingerprint": None, "choices": [], "usage": usage(self.finished.usage)})
        return out + b"data: [DONE]\n\n"

    async def events(self, first: omni_pb2.GenerateResponse, call: grpc.aio.UnaryStreamCall):
        """The SSE body, from the first response on. A failure midway is an error event (what OpenAI's clients raise);
        a client gone midway cancels this body, and with it the call."""
        try:
            r, role = first, self.chunk({"role": "assistant", "content": ""})
            while r is not None:
                self.add(r)
                if piece := self.delta(r):
                    yield role + piece  # the role's event leaves with the first one: one write less
                    role = b""
                r = await call.read()
                r = None if r is grpc.aio.EOF else r
        except grpc.aio.AioRpcError as e:
            yield _sse(from_grpc(e).body())
        finally:
            call.cancel()


async def collect(reply: Reply, call: grpc.aio.UnaryStreamCall) -> Response:
    while (r := await next_event(call)) is not None:
        reply.add(r)
    return JSONResponse(reply.whole())


def stream(reply: Reply, first: omni_pb2.GenerateResponse, call: grpc.aio.UnaryStreamCall) -> Response:
    return StreamingResponse(reply.events(first, call), media_type="text/event-stream", headers=SSE_HEADERS)
