"""/v1/realtime: OpenAI's Realtime protocol on a WebSocket, one Converse session of the gateway behind each, events
translated both ways. PCM16 at 24 kHz in and out, or G.711 at 8 kHz; the gateway resamples what it hears."""

import asyncio
import base64
import binascii
import copy
import itertools
import json

import av
import grpc
import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from omni.v1 import omni_pb2
from services.api import g711
from services.api.errors import ApiError, bad
from services.api.media import data_url
from services.api.realtime_config import FORMATS, PCM_RATE, Config
from services.runtime.security import key_matches

STATUS = {omni_pb2.TURN_STATUS_COMPLETED: ("completed", None), omni_pb2.TURN_STATUS_CANCELLED: ("cancelled", "client_cancelled"),
          omni_pb2.TURN_STATUS_INTERRUPTED: ("cancelled", "turn_detected"), omni_pb2.TURN_STATUS_FAILED: ("failed", "error")}
KEY_PROTOCOL = "openai-insecure-api-key."  # how a browser, which cannot set headers on a WebSocket, sends its key


class Bridge:
    """One WebSocket and its Converse call."""

    def __init__(self, ws: WebSocket, call, info: omni_pb2.ModelInfo):
        self.ws, self.call = ws, call
        self.cfg = Config(info.model, omni_pb2.MODALITY_AUDIO in info.output_modalities)
        self.ids = itertools.count()
        self.session_id = ""
        self.sessions = 0  # session events seen: the gateway's first is before our settings
        self.answers: dict[str, str] = {}  # turn id -> the answer's item id, while it is answered
        self.resampler = None  # 24 kHz -> 8 kHz for a G.711 answer, one per response

    def event_id(self) -> str:
        return f"event_{next(self.ids)}"

    async def send(self, type: str, **fields) -> None:
        await self.ws.send_text(json.dumps({"type": type, "event_id": self.event_id(), **fields}))

    async def error(self, e: ApiError, event_id: str | None = None) -> None:
        await self.send("error", error={"type": e.type, "code": e.code, "message": e.message, "param": e.param,
                                        "event_id": event_id})

    async def from_client(self) -> None:
        while True:
            text = await self.ws.receive_text()
            event_id = None
            try:
                try:
                    event = json.loads(text)
                except json.JSONDecodeError as e:
                    raise bad(f"the event is not valid JSON: {e}", code="invalid_json") from None
                if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                    raise bad("an event is a JSON object with a string `type`", "type", "invalid_event")
                event_id = event.get("event_id")
                for req in self.translate(event):
                    await self.call.write(req)
            except ApiError as e:
                await self.error(e, event_id)

    def translate(self, event: dict) -> list[omni_pb2.ConverseRequest]:
        kind = event["type"]
        if kind == "session.update":
            cfg = copy.deepcopy(self.cfg)  # all of the update or none of it
            cfg.update(event.get("session"))
            cfg.settings()
            self.cfg = cfg
            return [omni_pb2.ConverseRequest(settings=self.cfg.settings())]
        if kind == "input_audio_buffer.append":
            return [omni_pb2.ConverseRequest(audio=self.audio_in(event.get("audio"), "audio"))]
        if kind == "input_audio_buffer.commit":
            return [omni_pb2.ConverseRequest(commit=omni_pb2.Commit(hold=True))]
        if kind == "input_audio_buffer.clear":
            return [omni_pb2.ConverseRequest(clear=omni_pb2.Clear())]
        if kind == "conversation.item.create":
            item = event.get("item")
            item_id = item.get("id") if isinstance(item, dict) else None
            if item_id is not None and (not isinstance(item_id, str) or not item_id):
                raise bad("item.id: a non-empty string", "item.id", "invalid_value")
            return [omni_pb2.ConverseRequest(item=self.message(item)),
                    omni_pb2.ConverseRequest(commit=omni_pb2.Commit(hold=True, item_id=item_id or ""))]
        if kind == "conversation.item.delete":
            return [omni_pb2.ConverseRequest(delete_item=omni_pb2.DeleteItem(item_id=self.item_id(event)))]
        if kind == "conversation.item.truncate":
            item_id, end = self.item_id(event), event.get("audio_end_ms")
            if event.get("content_index", 0) != 0:
                raise bad("content_index: an item has one content part, 0", "content_index", "invalid_value")
            if not isinstance(end, int) or isinstance(end, bool) or end < 0:
                raise bad("audio_end_ms: milliseconds of the item's audio, an integer of 0 or more", "audio_end_ms", "invalid_value")
            return [omni_pb2.ConverseRequest(truncate_item=omni_pb2.TruncateItem(item_id=item_id, audio_end_seconds=end / 1000))]
        if kind == "response.create":
            return [omni_pb2.ConverseRequest(commit=omni_pb2.Commit())]
        if kind == "response.cancel":
            return [omni_pb2.ConverseRequest(cancel=omni_pb2.Cancel())]
        raise bad(f"unknown or unsupported event type {kind!r}", "type", "invalid_event")

    @staticmethod
    def item_id(event: dict) -> str:
        item_id = event.get("item_id")
        if not isinstance(item_id, str) or not item_id:
            raise bad("item_id: the id of an item in the conversation is required", "item_id", "invalid_value")
        return item_id

    def audio_in(self, data, where: str) -> bytes:
        if not isinstance(data, str):
            raise bad(f"{where}: base64 audio is required", where, "invalid_value")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{where}: not valid base64", where, "invalid_base64") from None
        law = FORMATS[self.cfg.input_format]
        return g711.decode(raw, law) if law else raw

    def message(self, item) -> omni_pb2.Message:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise bad("item: only message items are served", "item.type", "invalid_value")
        if item.get("role", "user") != "user":
            raise bad(f"item.role: {item.get('role')!r} items are not served; instructions go in session.update",
                      "item.role", "invalid_value")
        parts = []
        for i, c in enumerate(item.get("content") or []):
            where, kind = f"item.content[{i}]", c.get("type") if isinstance(c, dict) else None
            if kind in ("input_text", "text"):
                parts.append(omni_pb2.Part(text=str(c.get("text", ""))))
            elif kind == "input_audio":
                rate = g711.RATE if FORMATS[self.cfg.input_format] else PCM_RATE
                parts.append(omni_pb2.Part(audio=omni_pb2.Audio(pcm=omni_pb2.RawPcm(
                    data=self.audio_in(c.get("audio"), where + ".audio"), sample_rate=rate, encoding=omni_pb2.PCM_ENCODING_S16LE))))
            elif kind == "input_image":
                url = c.get("image_url")
                if not isinstance(url, str):
                    raise bad(f"{where}.image_url: a data URL is required", where + ".image_url", "invalid_value")
                parts.append(omni_pb2.Part(image=omni_pb2.Image(data=data_url(url, where + ".image_url"))))
            else:
                raise bad(f"{where}: unsupported content type {kind!r} (input_text, input_audio, input_image)", where, "invalid_value")
        if not parts:
            raise bad("item.content is empty", "item.content", "invalid_value")
        return omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=parts)

    def audio_out(self, pcm16: bytes) -> bytes:
        law = FORMATS[self.cfg.output_format]
        if not law:
            return pcm16
        if self.resampler is None:
            self.resampler = av.AudioResampler(format="s16", layout="mono", rate=g711.RATE)
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm16, "<i2").reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = PCM_RATE
        return g711.encode(b"".join(f.to_ndarray().tobytes() for f in self.resampler.resample(frame)), law)

    async def to_client(self) -> None:
        async for r in self.call:
            await self.forward(r)

    async def forward(self, r: omni_pb2.ConverseResponse) -> None:
        kind = r.WhichOneof("event")
        if kind == "started":
            self.answers[r.turn_id] = r.started.item_id
        rid, item = f"resp_{r.turn_id}", self.answers.get(r.turn_id, "")
        out = {"response_id": rid, "item_id": item, "output_index": 0, "content_index": 0}
        if kind == "session":
            self.session_id, self.sessions = r.session.session_id, self.sessions + 1
            if self.sessions > 1:
                await self.send("session.created" if self.sessions == 2 else "session.updated", session=self.cfg.describe(self.session_id))
        elif kind == "speech_started":
            await self.send("input_audio_buffer.speech_started", item_id=r.speech_started.item_id,
                            audio_start_ms=round(r.speech_started.audio_start_seconds * 1000))
        elif kind == "speech_stopped":
            await self.send("input_audio_buffer.speech_stopped", item_id=r.speech_stopped.item_id,
                            audio_end_ms=round(r.speech_stopped.audio_end_seconds * 1000))
        elif kind == "committed":
            item_id = r.committed.item_id
            await self.send("input_audio_buffer.committed", item_id=item_id, previous_item_id=None)
            await self.send("conversation.item.added", previous_item_id=None, item={
                "id": item_id, "type": "message", "role": "user", "status": "completed", "content": []})
        elif kind == "started":
            self.resampler = None
            await self.send("response.created", response={"id": rid, "object": "realtime.response", "status": "in_progress",
                                                          "output": [], "conversation_id": self.session_id})
        elif kind == "text":
            name = "response.output_audio_transcript.delta" if self.cfg.audio_out else "response.output_text.delta"
            if r.text.text:
                await self.send(name, delta=r.text.text, **out)
        elif kind == "audio":
            if r.audio.data:
                await self.send("response.output_audio.delta", delta=base64.b64encode(self.audio_out(r.audio.data)).decode(), **out)
        elif kind == "done":
            await self.done(r, rid, self.answers.pop(r.turn_id, item))
        elif kind == "item_deleted":
            await self.send("conversation.item.deleted", item_id=r.item_deleted.item_id)
        elif kind == "item_truncated":
            t = r.item_truncated
            await self.send("conversation.item.truncated", item_id=t.item_id, content_index=0,
                            audio_end_ms=round(t.audio_end_seconds * 1000))
        elif kind == "cleared":
            await self.send("input_audio_buffer.cleared")
        elif kind == "error":
            e = r.error
            await self.send("error", error={"type": "invalid_request_error", "code": e.code.lower(), "message": e.message,
                                            "param": None, "event_id": None})

    async def done(self, r: omni_pb2.ConverseResponse, rid: str, item: str) -> None:
        d = r.done
        status, reason = STATUS.get(d.status, ("failed", "error"))
        content = {"type": "output_audio", "transcript": d.transcript} if self.cfg.audio_out else {"type": "output_text", "text": d.transcript}
        u = d.usage
        await self.send("response.done", response={
            "id": rid, "object": "realtime.response", "status": status, "conversation_id": self.session_id,
            "status_details": None if reason is None else {"type": status, "reason": reason},
            "output": [{"id": item, "type": "message", "role": "assistant", "status": "completed", "content": [content]}],
            "usage": {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                      "total_tokens": u.prompt_tokens + u.completion_tokens},
        })


async def serve(ws: WebSocket, upstream, keys: list[bytes]) -> None:
    """One WebSocket's session, ended (and every stage let go of it) when either side leaves."""
    protocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    key = next((p[len(KEY_PROTOCOL):] for p in protocols if p.startswith(KEY_PROTOCOL)), None)
    authorization = ws.headers.get("authorization") or (f"Bearer {key}" if key else None)
    if (why := key_matches(keys, authorization)) is not None:
        await ws.close(code=1008, reason=why[:120])
        return
    await ws.accept(subprotocol="realtime" if "realtime" in protocols else None)
    try:
        info = await upstream.info()
    except ApiError as e:
        await ws.send_text(json.dumps({"type": "error", "error": e.body()["error"]}))
        await ws.close(code=1011)
        return
    model = ws.query_params.get("model") or info.model
    if model != info.model:
        await ws.send_text(json.dumps({"type": "error", "error": {"type": "invalid_request_error", "code": "model_not_found",
                                                                  "message": f"The model `{model}` does not exist.", "param": "model"}}))
        await ws.close(code=1008)
        return
    call = upstream.stub.Converse(metadata=upstream.metadata)
    bridge = Bridge(ws, call, info)
    await call.write(omni_pb2.ConverseRequest(settings=bridge.cfg.settings()))
    tasks = [asyncio.create_task(bridge.from_client()), asyncio.create_task(bridge.to_client())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.exception() is not None and not isinstance(t.exception(), (WebSocketDisconnect, grpc.aio.AioRpcError)):
                raise t.exception()
    finally:
        call.cancel()
        for t in tasks:
            t.cancel()
        if not any(isinstance(t.exception(), WebSocketDisconnect) for t in tasks if t.done() and not t.cancelled()):
            try:
                await ws.close()
            except RuntimeError:  # already closed by the client
                pass
