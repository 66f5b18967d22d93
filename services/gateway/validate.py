"""Checks a public GenerateRequest and resolves it against the deployment's defaults and limits."""

from dataclasses import dataclass

from omni.v1 import omni_pb2
from services.gateway.prompt import MediaRef, PromptBuilder
from services.llm.sampling import SamplingParams
from services.model.media_tokens import MediaSizes
from services.model.spec import OmniSpec
from services.preprocess import headers
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


def check_context(r: Resolved, prompts: PromptBuilder, sizes: MediaSizes, limits: Limits, context: int) -> list[int]:
    """The prompt's template ids; refuses, before any media is decoded, a request whose text, media (counted from
    their headers) and max_tokens are past the context."""
    ids = prompts.template(r.messages)
    media = [ref for m in r.media for ref in media_tokens(m, sizes, limits)]
    n = prompts.length(ids, media)
    if n + r.thinker.max_tokens > context:
        of_media = sum(m.num_tokens for m in media)
        counted = f" ({of_media} of them media, counted from their headers)" if of_media else ""
        raise InvalidArgument(f"prompt of {n} tokens{counted} + max_tokens {r.thinker.max_tokens} is past the context "
                              f"of {context}")
    return ids


def media_tokens(m, sizes: MediaSizes, limits: Limits) -> list[MediaRef]:
    """An item's tokens from its header alone, as the preprocess will lay it out (a video heard: its frames, then its
    soundtrack)."""
    kind = type(m).__name__.lower()
    heard = kind == "video" and m.use_audio_in_video
    try:
        refs = _counted(kind, m, sizes, limits)
    except ValueError:  # a shape the processor refuses
        refs = None
    # Its header cannot size it, or it is past its own limits: none counted, the preprocess refuses it in its own words
    return refs or [MediaRef(kind, 0, with_audio=heard)] + ([MediaRef("audio", 0)] if heard else [])


def _counted(kind: str, m, sizes: MediaSizes, limits: Limits) -> list[MediaRef] | None:
    if kind == "image":
        size = headers.image_size(m.data)
        if size is None or size[0] * size[1] > limits.max_image_pixels:
            return None
        grid = sizes.grid(*size)
        return [MediaRef("image", sizes.vision_tokens(grid), grid)]
    if kind == "audio":
        sound = headers.sound(m, sizes.sample_rate)
        return [_sound(sound.samples, sizes)] if sound and sound.seconds <= limits.max_audio_seconds else None
    f = headers.frames(m, sizes.temporal, sizes.sample_rate)
    if (f is None or not 0 < f.count <= limits.max_video_frames or f.width * f.height > limits.max_image_pixels
            or max(f.seconds, f.sound.seconds if f.sound else 0.0) > limits.max_audio_seconds
            or len(m.file) > limits.max_request_bytes):
        return None
    grid = sizes.grid(f.width, f.height, f.count)
    video = MediaRef("video", sizes.vision_tokens(grid), grid, with_audio=m.use_audio_in_video)
    if not m.use_audio_in_video:
        return [video]
    return [video, _sound(f.sound.samples, sizes) if f.sound else MediaRef("audio", 0)]


def _sound(samples: int, sizes: MediaSizes) -> MediaRef:
    return MediaRef("audio", sizes.sound_tokens(samples), feature_length=sizes.mel_frames(samples))
