"""OpenAI requests -> the public API's GenerateRequest: every turn kept as a turn with its role and parts, every field
either honoured or refused by name."""

from omni.v1 import omni_pb2
from services.api.audio_store import AudioStore
from services.api.errors import ApiError, bad, unsupported
from services.api.formats import AUDIO_FORMATS
from services.api.media import Fetcher, b64, media
from services.api.schema import AssistantMessage, ChatRequest, Sampling, SpeechRequest, SystemMessage

P = omni_pb2
ROLES = {"system": P.ROLE_SYSTEM, "developer": P.ROLE_SYSTEM, "user": P.ROLE_USER, "assistant": P.ROLE_ASSISTANT}
# What /v1/audio/speech asks the model: it speaks what it writes, so it is asked to write the input, word for word.
READ_ALOUD = "Read the user's text aloud exactly as written, word for word, and say nothing else."


def _refuse_unhonoured(req: ChatRequest) -> None:
    """OpenAI's fields this server cannot honour, taken only at the values that mean what it does."""
    allowed = {
        "n": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logprobs": (None, False),
        "top_logprobs": (None, 0), "tool_choice": (None, "none"), "store": (None, False),
        "service_tier": (None, "auto", "default"),
    }
    for name, ok in allowed.items():
        if getattr(req, name) not in ok:
            raise unsupported(name, f"only {' or '.join(repr(v) for v in ok if v is not None)} is supported here")
    for name in ("logit_bias", "tools", "metadata"):
        if getattr(req, name):
            raise unsupported(name)
    if req.response_format not in (None, {"type": "text"}):
        raise unsupported("response_format", "only {\"type\": \"text\"} is supported here")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options: only allowed when stream is true", "stream_options")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise unsupported("stream_options.include_obfuscation")


def _sampling(msg: P.SamplingParams, s: Sampling, where: str) -> None:
    if s.temperature is not None:
        if not 0 <= s.temperature <= 2:
            raise bad(f"{where}temperature: must be in [0, 2], got {s.temperature}", f"{where}temperature")
        msg.temperature = s.temperature
    if s.top_p is not None:
        msg.top_p = s.top_p
    if s.top_k is not None:
        msg.top_k = s.top_k
    if s.max_tokens is not None:
        if s.max_tokens < 1:
            raise bad(f"{where}max_tokens: must be at least 1, got {s.max_tokens}", f"{where}max_tokens")
        msg.max_tokens = s.max_tokens
    if s.min_tokens is not None:
        msg.min_tokens = s.min_tokens
    if s.seed is not None:
        if not 0 <= s.seed < 1 << 64:
            raise bad(f"{where}seed: must be in [0, 2^64), got {s.seed}", f"{where}seed")
        msg.seed = s.seed
    if s.repetition_penalty is not None:
        msg.repetition_penalty = s.repetition_penalty
    if s.ignore_eos:
        msg.ignore_eos = True


def _text(content, where: str) -> list[P.Part]:
    if isinstance(content, str):
        return [P.Part(text=content)]
    return [P.Part(text=p.text if p.type == "text" else p.refusal) for p in content]


async def _user_parts(content, where: str, fetcher: Fetcher | None) -> list[P.Part]:
    if isinstance(content, str):
        return [P.Part(text=content)]
    parts = []
    for j, p in enumerate(content):
        at = f"{where}.content[{j}]"
        if p.type == "text":
            parts.append(P.Part(text=p.text))
        elif p.type == "image_url":
            if p.image_url.detail not in (None, "auto"):
                raise unsupported(f"{at}.image_url.detail", "the model sees each image at its own resolution: only 'auto'")
            parts.append(P.Part(image=P.Image(data=await media(p.image_url.url, f"{at}.image_url.url", fetcher))))
        elif p.type == "input_audio":  # the format is the file's own business: its bytes are probed
            parts.append(P.Part(audio=P.Audio(file=b64(p.input_audio.data, f"{at}.input_audio.data"))))
        else:
            parts.append(P.Part(video=P.Video(file=await media(p.video_url.url, f"{at}.video_url.url", fetcher),
                                              use_audio_in_video=p.video_url.use_audio_in_video)))
    return parts


def _assistant_parts(m: AssistantMessage, where: str, store: AudioStore) -> list[P.Part]:
    """What the assistant said: its content, else its audio's transcript (sent back, or kept here by audio id)."""
    if m.tool_calls or m.function_call is not None:
        raise unsupported(f"{where}.tool_calls", "tools are not supported here")
    if m.annotations:
        raise unsupported(f"{where}.annotations")
    if m.content:
        return _text(m.content, where)
    if m.refusal:
        return [P.Part(text=m.refusal)]
    if m.audio is None:
        raise bad(f"{where}: an assistant message needs content or audio", f"{where}.content")
    transcript = m.audio.transcript if m.audio.transcript is not None else store.transcript(m.audio.id)
    if transcript is None:
        raise bad(f"{where}.audio.id: no audio {m.audio.id!r} here (unknown, or expired)", f"{where}.audio.id",
                  "audio_not_found")
    return [P.Part(text=transcript)]


async def chat_request(req: ChatRequest, store: AudioStore, fetcher: Fetcher | None) -> P.GenerateRequest:
    _refuse_unhonoured(req)
    out = P.GenerateRequest()
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.name:
            raise unsupported(f"{where}.name", "participant names are not supported here")
        if isinstance(m, SystemMessage):
            parts = _text(m.content, where)
        elif isinstance(m, AssistantMessage):
            parts = _assistant_parts(m, where, store)
        else:
            parts = await _user_parts(m.content, where, fetcher)
        out.messages.append(P.Message(role=ROLES[m.role], parts=parts))
    if req.mm_processor_kwargs is not None and req.mm_processor_kwargs.use_audio_in_video:
        for part in (p for m in out.messages for p in m.parts if p.HasField("video")):
            part.video.use_audio_in_video = True
    modalities = set(req.modalities or ["text"])
    if modalities not in ({"text"}, {"text", "audio"}):
        raise bad(f"modalities: must be [\"text\"] or [\"text\", \"audio\"], got {req.modalities}", "modalities")
    out.output_modalities.append(P.MODALITY_TEXT)
    if "audio" in modalities:
        if req.audio is None:
            raise bad("audio: required when modalities include \"audio\" (voice and format)", "audio")
        out.output_modalities.append(P.MODALITY_AUDIO)
        out.voice, out.audio_format = req.audio.voice, AUDIO_FORMATS[req.audio.format]
    elif req.audio is not None:
        raise bad("audio: given, but modalities do not include \"audio\"", "audio")
    if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
        raise bad("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise bad(f"stop: at most 4 sequences, got {len(stop)}", "stop")
    out.sampling.stop.extend(stop)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _sampling(out.sampling, Sampling(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=limit, min_tokens=req.min_tokens,
        seed=req.seed, repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos), "")
    if "audio" in modalities:
        talker = req.talker or Sampling()
        _sampling(out.talker_sampling, talker if talker.seed is not None else talker.model_copy(update={"seed": req.seed}),
                  "talker.")
    elif req.talker is not None:
        raise bad("talker: given, but modalities do not include \"audio\"", "talker")
    return out


def speech_request(req: SpeechRequest) -> P.GenerateRequest:
    if req.speed not in (None, 1.0):
        raise unsupported("speed", "the model speaks at one speed: only 1.0")
    system = READ_ALOUD + (f" How to read it: {req.instructions}" if req.instructions else "")
    out = P.GenerateRequest(
        messages=[P.Message(role=P.ROLE_SYSTEM, parts=[P.Part(text=system)]),
                  P.Message(role=P.ROLE_USER, parts=[P.Part(text=req.input)])],
        output_modalities=[P.MODALITY_AUDIO], voice=req.voice, audio_format=AUDIO_FORMATS[req.response_format])
    thinker = req.thinker or Sampling()
    _sampling(out.sampling, thinker if thinker.temperature is not None else thinker.model_copy(update={"temperature": 0.0}),
              "thinker.")
    _sampling(out.talker_sampling, req.talker or Sampling(), "talker.")
    return out


def check_size(gen: P.GenerateRequest, limit: int) -> None:
    if limit and gen.ByteSize() > limit:
        raise ApiError(413, f"the request holds {gen.ByteSize()} bytes of content, over this deployment's limit of "
                            f"{limit}", code="request_too_large")
