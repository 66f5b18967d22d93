"""Checks a public GenerateRequest and resolves it against the deployment's defaults and limits."""

from dataclasses import dataclass

from omni.v1 import omni_pb2
from services.llm.sampling import SamplingParams
from services.model.spec import OmniSpec
from services.runtime.config import Limits
from services.runtime.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

# A token of text is rarely more than a few characters: more than this many per token of context cannot fit it
CHARS_PER_TOKEN = 16
ROLE_NAMES = {omni_pb2.ROLE_SYSTEM: "system", omni_pb2.ROLE_USER: "user", omni_pb2.ROLE_ASSISTANT: "assistant"}


@dataclass
class Resolved:
    messages: list[dict]  # chat-template form, media parts as {"type": kind}
    media: list  # omni.v1 Image | Audio | Video messages, in prompt order
    want_text: bool
    want_audio: bool
    voice: str
    thinker: SamplingParams
    talker: SamplingParams | None
    audio_format: int
    stop: list[str]
    return_codes: bool


def _sampling(msg: omni_pb2.SamplingParams, defaults: dict, limit: int, where: str,
              stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    """`msg` over the model's `defaults`; at most `limit` tokens, also the default."""
    temperature = msg.temperature if msg.HasField("temperature") else defaults["temperature"]
    top_p = msg.top_p if msg.HasField("top_p") else defaults["top_p"]
    top_k = msg.top_k if msg.HasField("top_k") else defaults["top_k"]
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else limit
    min_tokens = msg.min_tokens if msg.HasField("min_tokens") else 0
    penalty = msg.repetition_penalty if msg.HasField("repetition_penalty") else defaults["repetition_penalty"]
    if not temperature >= 0:
        raise InvalidArgument(f"{where}.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"{where}.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidArgument(f"{where}.top_k must be >= 0, got {top_k}")
    if max_tokens < 1:
        raise InvalidArgument(f"{where}.max_tokens must be at least 1, got {max_tokens}")
    if max_tokens > limit:
        raise InvalidArgument(f"{where}.max_tokens {max_tokens} is over this deployment's limit of {limit}")
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidArgument(f"{where}.min_tokens must be in [0, max_tokens], got {min_tokens}")
    if not penalty > 0:
        raise InvalidArgument(f"{where}.repetition_penalty must be > 0, got {penalty}")
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, min_tokens=min_tokens,
        seed=msg.seed if msg.HasField("seed") else 0, ignore_eos=msg.ignore_eos, repetition_penalty=penalty,
        stop_token_ids=stop_ids,
    )


def resolve(req: omni_pb2.GenerateRequest, spec: OmniSpec, limits: Limits, talker_available: bool,
            check_text) -> Resolved:
    if not req.messages:
        raise InvalidArgument("messages is empty")
    messages, media = [], []
    chars, most = 0, (limits.max_context_tokens or spec.max_positions) * CHARS_PER_TOKEN
    for i, m in enumerate(req.messages):
        role = ROLE_NAMES.get(m.role)
        if role is None:
            raise InvalidArgument(f"messages[{i}]: unknown role {m.role}")
        if not m.parts:
            raise InvalidArgument(f"messages[{i}]: no content")
        content = []
        for j, part in enumerate(m.parts):
            kind = part.WhichOneof("content")
            if kind is None:
                raise InvalidArgument(f"messages[{i}].parts[{j}]: empty part")
            if kind == "text":
                chars += len(part.text)
                if chars > most:  # before any scan or tokenising of it
                    raise InvalidArgument(f"messages[{i}].parts[{j}]: the text so far is {chars} characters, more than "
                                          f"a context of {most // CHARS_PER_TOKEN} tokens can hold")
                check_text(part.text, f"messages[{i}].parts[{j}]")
                content.append({"type": "text", "text": part.text})
            else:
                if kind == "video" and part.video.use_audio_in_video and not part.video.file:
                    raise InvalidArgument(f"messages[{i}].parts[{j}]: use_audio_in_video needs a video file (frames have no sound)")
                content.append({"type": kind})
                media.append(getattr(part, kind))
        messages.append({"role": role, "content": content})
    if len(media) > limits.max_media_items:
        raise ResourceExhausted(f"{len(media)} media items is over the limit of {limits.max_media_items}")
    modalities = set(req.output_modalities) or {omni_pb2.MODALITY_TEXT}
    if omni_pb2.MODALITY_UNSPECIFIED in modalities:
        raise InvalidArgument("output_modalities contains MODALITY_UNSPECIFIED")
    unknown = sorted(modalities - set(omni_pb2.Modality.values()))
    if unknown:
        raise InvalidArgument(f"output_modalities: unknown modality {unknown[0]} (text is 1, audio 2)")
    want_audio = omni_pb2.MODALITY_AUDIO in modalities
    if want_audio and not talker_available:
        raise FailedPrecondition("audio output was asked for, but this deployment has no talker")
    voice = (req.voice or spec.default_voice).lower()
    if want_audio and voice not in spec.voices:
        raise InvalidArgument(f"unknown voice {req.voice}; known voices: {', '.join(sorted(spec.voices))}")
    stop_ids = (spec.raw["im_end_token_id"],)
    for j, s in enumerate(req.sampling.stop):
        if not s:
            raise InvalidArgument(f"sampling.stop[{j}] is empty")
    thinker = _sampling(req.sampling, spec.thinker_sampling, limits.max_new_tokens, "sampling", stop_ids)
    talker = (_sampling(req.talker_sampling, spec.talker_sampling, limits.max_talker_frames, "talker_sampling")
              if want_audio else None)
    if req.audio_format not in omni_pb2.AudioFormat.values():
        raise InvalidArgument(f"unknown audio_format {req.audio_format}")
    return Resolved(messages, media, omni_pb2.MODALITY_TEXT in modalities, want_audio, voice, thinker, talker,
                    req.audio_format or omni_pb2.AUDIO_FORMAT_PCM16, list(req.sampling.stop), req.return_codec_codes)
