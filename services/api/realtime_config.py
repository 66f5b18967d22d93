"""A /v1/realtime session's settings as OpenAI's Realtime protocol gives them, merged over each session.update, and
the Converse settings they make."""

from pydantic import ValidationError

from omni.v1 import omni_pb2
from services.api import g711
from services.api.errors import bad
from services.api.schema import Sampling
from services.api.translate import _sampling

PCM_RATE = 24000
FORMATS = {"audio/pcm": None, "audio/pcmu": "mulaw", "audio/pcma": "alaw"}
LEGACY_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
DEFAULT_SILENCE_MS = 500


def _format(value, where: str) -> str:
    kind = value.get("type") if isinstance(value, dict) else LEGACY_FORMATS.get(value, value)
    if kind not in FORMATS:
        raise bad(f"{where}: unsupported audio format {kind!r}; this server takes {', '.join(FORMATS)}", where, "invalid_value")
    if kind == "audio/pcm" and isinstance(value, dict) and value.get("rate", PCM_RATE) != PCM_RATE:
        raise bad(f"{where}: audio/pcm is at {PCM_RATE} Hz, not {value.get('rate')}", where, "invalid_value")
    return kind


class Config:
    """The session as the client configured it, merged over each session.update, and its Converse settings."""

    def __init__(self, model: str, audio_out: bool):
        self.model = model
        self.audio_out = audio_out  # OpenAI's default where the deployment speaks
        self.instructions = ""
        self.voice = ""
        self.input_format = self.output_format = "audio/pcm"
        self.vad: dict | None = {"type": "server_vad", "silence_duration_ms": DEFAULT_SILENCE_MS}
        self.max_tokens: int | None = None
        # Extensions, as the chat door names them: the text's sampling beyond OpenAI's, and the speech's
        self.sampling, self.talker = Sampling(), Sampling()

    def update(self, s: dict) -> None:
        if not isinstance(s, dict):
            raise bad("session.update: session must be an object", "session", "invalid_value")
        mods = s.get("output_modalities", s.get("modalities"))
        if mods is not None:
            if not isinstance(mods, list) or not set(mods) <= {"text", "audio"} or not mods:
                raise bad("session.output_modalities: a list of 'text' and 'audio'", "session.output_modalities", "invalid_value")
            self.audio_out = "audio" in mods
        if "instructions" in s:
            self.instructions = str(s["instructions"] or "")
        audio = s.get("audio") or {}
        inp, out = audio.get("input") or {}, audio.get("output") or {}
        if "format" in inp or "input_audio_format" in s:
            self.input_format = _format(inp.get("format", s.get("input_audio_format")), "session.audio.input.format")
        if "format" in out or "output_audio_format" in s:
            self.output_format = _format(out.get("format", s.get("output_audio_format")), "session.audio.output.format")
        if "voice" in out or "voice" in s:
            self.voice = str(out.get("voice", s.get("voice")) or "")
        if "turn_detection" in inp or "turn_detection" in s:
            vad = inp.get("turn_detection", s.get("turn_detection"))
            if vad is not None and (not isinstance(vad, dict) or vad.get("type", "server_vad") != "server_vad"):
                raise bad("session.audio.input.turn_detection: only server_vad (or null, the client commits) is served",
                          "session.audio.input.turn_detection", "invalid_value")
            self.vad = vad
        if "max_output_tokens" in s or "max_response_output_tokens" in s:
            n = s.get("max_output_tokens", s.get("max_response_output_tokens"))
            if n not in (None, "inf") and (not isinstance(n, int) or n < 1):
                raise bad(f"session.max_output_tokens: a positive integer or 'inf', got {n!r}", "session.max_output_tokens", "invalid_value")
            self.max_tokens = None if n in (None, "inf") else n
        for key in ("sampling", "talker"):
            if key in s:
                try:
                    setattr(self, key, Sampling.model_validate(s[key] or {}))
                except ValidationError as e:
                    raise bad(f"session.{key}: {e.errors()[0]['msg']} at {e.errors()[0]['loc']}", f"session.{key}", "invalid_value") from None

    def settings(self) -> omni_pb2.SessionSettings:
        law = FORMATS[self.input_format]
        s = omni_pb2.SessionSettings(
            output_modalities=[omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if self.audio_out else []),
            voice=self.voice, instructions=self.instructions, input_encoding=omni_pb2.PCM_ENCODING_S16LE,
            input_sample_rate=g711.RATE if law else PCM_RATE, audio_format=omni_pb2.AUDIO_FORMAT_PCM16)
        _sampling(s.sampling, self.sampling, "session.sampling.")
        _sampling(s.talker_sampling, self.talker, "session.talker.")
        if self.max_tokens is not None:
            s.sampling.max_tokens = self.max_tokens
        if self.vad is not None:
            t = s.turn_detection
            t.enabled = True
            t.silence_ms = int(self.vad.get("silence_duration_ms", DEFAULT_SILENCE_MS))
            if "threshold" in self.vad:  # OpenAI's 0..1 (higher: fewer frames are speech) on WebRTC's 0..3
                t.aggressiveness = min(3, max(0, int(float(self.vad["threshold"]) * 4)))
        return s

    def describe(self, session_id: str) -> dict:
        fmt = lambda kind: {"type": kind, "rate": PCM_RATE if kind == "audio/pcm" else g711.RATE}  # noqa: E731
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "output_modalities": ["audio"] if self.audio_out else ["text"], "instructions": self.instructions,
            "max_output_tokens": "inf" if self.max_tokens is None else self.max_tokens,
            "audio": {"input": {"format": fmt(self.input_format), "turn_detection": self.vad},
                      "output": {"format": fmt(self.output_format), "voice": self.voice or None}},
        }
