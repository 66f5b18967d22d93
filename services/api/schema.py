"""The request bodies of the OpenAI API as this server takes them: every field OpenAI defines that a client may send
is declared (those we cannot honour are refused by name in translate.py unless they mean what we do), and any
other field is refused by name here (extra="forbid")."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "webm", "m4a")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


class ImageUrl(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(Strict):
    data: str
    format: Literal[INPUT_AUDIO_FORMATS]


class AudioPart(Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoUrl(Strict):
    url: str
    use_audio_in_video: bool = False  # the model hears the file's soundtrack too (omni.v1.Video.use_audio_in_video)


class VideoPart(Strict):
    """Not in OpenAI's API; the name vLLM and SGLang use for a video file (a data URL)."""
    type: Literal["video_url"]
    video_url: VideoUrl


UserPart = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class SystemMessage(Strict):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class AssistantAudio(Strict):
    """An earlier reply's audio: by `id` (OpenAI's form), or the whole `message.audio` of a reply sent back."""
    id: str
    data: str | None = None
    transcript: str | None = None
    expires_at: int | None = None


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    audio: AssistantAudio | None = None
    refusal: str | None = None
    name: str | None = None
    # What a reply carries when it is sent back whole (openai's ChatCompletionMessage); refused unless empty.
    tool_calls: list[Any] | None = None
    function_call: Any = None
    annotations: list[Any] | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage, Field(discriminator="role")]


class AudioOut(Strict):
    voice: str
    format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm16"]


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class Sampling(Strict):
    """Sampling settings outside OpenAI's API, named as vLLM names them; under `talker` (extra_body) for the speech."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None


class MmProcessorKwargs(Strict):
    """vLLM's processor options for Qwen-Omni: the one this server takes, for the whole request."""
    use_audio_in_video: bool | None = None  # every video part heard too, as its own use_audio_in_video


class ChatRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOut | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    # Taken only where they mean what this server does (checked in translate.py).
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Identifies the end user to the operator; changes nothing in the reply.
    user: str | None = None
    # Extensions (extra_body), vLLM's names: the thinker's sampling beyond OpenAI's, and the talker's.
    top_k: int | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    talker: Sampling | None = None
    mm_processor_kwargs: MmProcessorKwargs | None = None


class SpeechRequest(Strict):
    model: str
    input: str = Field(min_length=1)
    voice: str
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float | None = None
    stream_format: Literal["sse", "audio"] = "audio"
    # Extensions (extra_body): the sampling of the text the model reads out (greedy unless set) and of the speech.
    thinker: Sampling | None = None
    talker: Sampling | None = None
