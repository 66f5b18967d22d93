"""The same request through both doors: a public-API GenerateRequest written as OpenAI's chat body, and the
streamed chat read back as the gRPC client reads its stream."""

import base64
from dataclasses import dataclass, field

from omni.v1 import omni_pb2

ROLE = {omni_pb2.ROLE_SYSTEM: "system", omni_pb2.ROLE_USER: "user", omni_pb2.ROLE_ASSISTANT: "assistant"}


def as_chat(req: omni_pb2.GenerateRequest, model: str = "tiny", audio_format: str = "pcm16") -> dict:
    """The OpenAI body of `req` (text, image, audio-file and video-file parts; both samplings), token ids asked back."""
    messages = []
    for m in req.messages:
        parts = []
        for p in m.parts:
            kind = p.WhichOneof("content")
            if kind == "text":
                parts.append({"type": "text", "text": p.text})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p.image.data).decode()}})
            elif kind == "audio":
                parts.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(p.audio.file).decode(), "format": "wav"}})
            elif kind == "video" and p.video.file:
                url = {"url": "data:video/mp4;base64," + base64.b64encode(p.video.file).decode()}
                parts.append({"type": "video_url", "video_url": url | ({"use_audio_in_video": True} if p.video.use_audio_in_video else {})})
            else:
                raise ValueError(f"no OpenAI form for a {kind} part")
        messages.append({"role": ROLE[m.role], "content": parts})
    body = {"model": model, "messages": messages, "return_token_ids": True}
    s = req.sampling
    for name in ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed", "repetition_penalty"):
        if s.HasField(name):
            body[name] = getattr(s, name)
    if s.ignore_eos:
        body["ignore_eos"] = True
    if omni_pb2.MODALITY_AUDIO in req.output_modalities:
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"voice": req.voice or "ethan", "format": audio_format}
        t = req.talker_sampling
        body["talker"] = {name: getattr(t, name) for name in ("temperature", "top_p", "top_k", "max_tokens", "seed")
                          if t.HasField(name)} | ({"ignore_eos": True} if t.ignore_eos else {})
    return body


@dataclass
class Streamed:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    audio: bytes = b""
    audio_deltas: int = 0
    transcript: str = ""
    audio_id: str | None = None
    expires_at: int | None = None
    finish_reason: str | None = None
    usage: object = None
    chunks: int = 0


def read_stream(stream) -> Streamed:
    """An openai chat stream (stream=True) read to its end."""
    out = Streamed()
    for chunk in stream:
        out.chunks += 1
        if chunk.usage is not None:
            out.usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            out.text += d.content or ""
            out.token_ids += (choice.model_extra or {}).get("token_ids") or []
            if d.audio is not None:
                out.audio_id = d.audio.id or out.audio_id
                out.transcript += d.audio.transcript or ""
                out.expires_at = d.audio.expires_at or out.expires_at
                if d.audio.data:
                    out.audio += base64.b64decode(d.audio.data)
                    out.audio_deltas += 1
            out.finish_reason = choice.finish_reason or out.finish_reason
    return out
