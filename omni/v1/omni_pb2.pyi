from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_TEXT: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]

class AudioFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_FORMAT_UNSPECIFIED: _ClassVar[AudioFormat]
    AUDIO_FORMAT_PCM16: _ClassVar[AudioFormat]
    AUDIO_FORMAT_WAV: _ClassVar[AudioFormat]
    AUDIO_FORMAT_MP3: _ClassVar[AudioFormat]
    AUDIO_FORMAT_OPUS: _ClassVar[AudioFormat]
    AUDIO_FORMAT_AAC: _ClassVar[AudioFormat]
    AUDIO_FORMAT_FLAC: _ClassVar[AudioFormat]

class PcmEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PCM_ENCODING_UNSPECIFIED: _ClassVar[PcmEncoding]
    PCM_ENCODING_S16LE: _ClassVar[PcmEncoding]
    PCM_ENCODING_F32LE: _ClassVar[PcmEncoding]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]

class TurnStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_STATUS_UNSPECIFIED: _ClassVar[TurnStatus]
    TURN_STATUS_COMPLETED: _ClassVar[TurnStatus]
    TURN_STATUS_CANCELLED: _ClassVar[TurnStatus]
    TURN_STATUS_INTERRUPTED: _ClassVar[TurnStatus]
    TURN_STATUS_FAILED: _ClassVar[TurnStatus]
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
MODALITY_UNSPECIFIED: Modality
MODALITY_TEXT: Modality
MODALITY_AUDIO: Modality
AUDIO_FORMAT_UNSPECIFIED: AudioFormat
AUDIO_FORMAT_PCM16: AudioFormat
AUDIO_FORMAT_WAV: AudioFormat
AUDIO_FORMAT_MP3: AudioFormat
AUDIO_FORMAT_OPUS: AudioFormat
AUDIO_FORMAT_AAC: AudioFormat
AUDIO_FORMAT_FLAC: AudioFormat
PCM_ENCODING_UNSPECIFIED: PcmEncoding
PCM_ENCODING_S16LE: PcmEncoding
PCM_ENCODING_F32LE: PcmEncoding
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
TURN_STATUS_UNSPECIFIED: TurnStatus
TURN_STATUS_COMPLETED: TurnStatus
TURN_STATUS_CANCELLED: TurnStatus
TURN_STATUS_INTERRUPTED: TurnStatus
TURN_STATUS_FAILED: TurnStatus

class Image(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class RawPcm(_message.Message):
    __slots__ = ("data", "sample_rate", "encoding", "channels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sample_rate: int
    encoding: PcmEncoding
    channels: int
    def __init__(self, data: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., encoding: _Optional[_Union[PcmEncoding, str]] = ..., channels: _Optional[int] = ...) -> None: ...

class Audio(_message.Message):
    __slots__ = ("file", "pcm")
    FILE_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    file: bytes
    pcm: RawPcm
    def __init__(self, file: _Optional[bytes] = ..., pcm: _Optional[_Union[RawPcm, _Mapping]] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("frames", "fps", "file", "use_audio_in_video")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    USE_AUDIO_IN_VIDEO_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Image]
    fps: float
    file: bytes
    use_audio_in_video: bool
    def __init__(self, frames: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., fps: _Optional[float] = ..., file: _Optional[bytes] = ..., use_audio_in_video: _Optional[bool] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("text", "image", "audio", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    audio: Audio
    video: Video
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ..., audio: _Optional[_Union[Audio, _Mapping]] = ..., video: _Optional[_Union[Video, _Mapping]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed", "stop", "ignore_eos", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    min_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "messages", "output_modalities", "voice", "sampling", "talker_sampling", "audio_format", "return_codec_codes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TALKER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    RETURN_CODEC_CODES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    output_modalities: _containers.RepeatedScalarFieldContainer[Modality]
    voice: str
    sampling: SamplingParams
    talker_sampling: SamplingParams
    audio_format: AudioFormat
    return_codec_codes: bool
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., output_modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., voice: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., talker_sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., audio_format: _Optional[_Union[AudioFormat, str]] = ..., return_codec_codes: _Optional[bool] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("data", "format", "sample_rate", "index", "start_seconds", "duration_seconds", "codec_codes", "num_codebooks")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CODEC_CODES_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    format: AudioFormat
    sample_rate: int
    index: int
    start_seconds: float
    duration_seconds: float
    codec_codes: _containers.RepeatedScalarFieldContainer[int]
    num_codebooks: int
    def __init__(self, data: _Optional[bytes] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., sample_rate: _Optional[int] = ..., index: _Optional[int] = ..., start_seconds: _Optional[float] = ..., duration_seconds: _Optional[float] = ..., codec_codes: _Optional[_Iterable[int]] = ..., num_codebooks: _Optional[int] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("stage", "seconds")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    seconds: float
    def __init__(self, stage: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "audio_seconds", "audio_frames", "time_to_first_token_seconds", "time_to_first_audio_seconds", "timings")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    audio_seconds: float
    audio_frames: int
    time_to_first_token_seconds: float
    time_to_first_audio_seconds: float
    timings: _containers.RepeatedCompositeFieldContainer[StageTiming]
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., audio_frames: _Optional[int] = ..., time_to_first_token_seconds: _Optional[float] = ..., time_to_first_audio_seconds: _Optional[float] = ..., timings: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "audio", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: TextDelta
    audio: AudioChunk
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[_Union[TextDelta, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_request_bytes", "max_media_items", "max_image_pixels", "max_audio_seconds", "max_video_frames", "max_context_tokens", "max_new_tokens")
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MEDIA_ITEMS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_VIDEO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_request_bytes: int
    max_media_items: int
    max_image_pixels: int
    max_audio_seconds: float
    max_video_frames: int
    max_context_tokens: int
    max_new_tokens: int
    def __init__(self, max_request_bytes: _Optional[int] = ..., max_media_items: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_audio_seconds: _Optional[float] = ..., max_video_frames: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "input_modalities", "output_modalities", "voices", "default_voice", "audio_sample_rate", "limits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    VOICES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VOICE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    input_modalities: _containers.RepeatedScalarFieldContainer[str]
    output_modalities: _containers.RepeatedScalarFieldContainer[Modality]
    voices: _containers.RepeatedScalarFieldContainer[str]
    default_voice: str
    audio_sample_rate: int
    limits: Limits
    def __init__(self, model: _Optional[str] = ..., input_modalities: _Optional[_Iterable[str]] = ..., output_modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., voices: _Optional[_Iterable[str]] = ..., default_voice: _Optional[str] = ..., audio_sample_rate: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class TurnDetection(_message.Message):
    __slots__ = ("enabled", "aggressiveness", "silence_ms", "speech_ms")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    AGGRESSIVENESS_FIELD_NUMBER: _ClassVar[int]
    SILENCE_MS_FIELD_NUMBER: _ClassVar[int]
    SPEECH_MS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    aggressiveness: int
    silence_ms: int
    speech_ms: int
    def __init__(self, enabled: _Optional[bool] = ..., aggressiveness: _Optional[int] = ..., silence_ms: _Optional[int] = ..., speech_ms: _Optional[int] = ...) -> None: ...

class SessionSettings(_message.Message):
    __slots__ = ("output_modalities", "voice", "instructions", "sampling", "talker_sampling", "audio_format", "input_encoding", "input_sample_rate", "turn_detection", "return_codec_codes")
    OUTPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TALKER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    INPUT_ENCODING_FIELD_NUMBER: _ClassVar[int]
    INPUT_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    TURN_DETECTION_FIELD_NUMBER: _ClassVar[int]
    RETURN_CODEC_CODES_FIELD_NUMBER: _ClassVar[int]
    output_modalities: _containers.RepeatedScalarFieldContainer[Modality]
    voice: str
    instructions: str
    sampling: SamplingParams
    talker_sampling: SamplingParams
    audio_format: AudioFormat
    input_encoding: PcmEncoding
    input_sample_rate: int
    turn_detection: TurnDetection
    return_codec_codes: bool
    def __init__(self, output_modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., voice: _Optional[str] = ..., instructions: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., talker_sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., audio_format: _Optional[_Union[AudioFormat, str]] = ..., input_encoding: _Optional[_Union[PcmEncoding, str]] = ..., input_sample_rate: _Optional[int] = ..., turn_detection: _Optional[_Union[TurnDetection, _Mapping]] = ..., return_codec_codes: _Optional[bool] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("hold", "item_id")
    HOLD_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    hold: bool
    item_id: str
    def __init__(self, hold: _Optional[bool] = ..., item_id: _Optional[str] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Clear(_message.Message):
    __slots__ = ("history",)
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    history: bool
    def __init__(self, history: _Optional[bool] = ...) -> None: ...

class DeleteItem(_message.Message):
    __slots__ = ("item_id",)
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    def __init__(self, item_id: _Optional[str] = ...) -> None: ...

class TruncateItem(_message.Message):
    __slots__ = ("item_id", "audio_end_seconds")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_END_SECONDS_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    audio_end_seconds: float
    def __init__(self, item_id: _Optional[str] = ..., audio_end_seconds: _Optional[float] = ...) -> None: ...

class ConverseRequest(_message.Message):
    __slots__ = ("settings", "audio", "item", "commit", "cancel", "clear", "delete_item", "truncate_item")
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    DELETE_ITEM_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_ITEM_FIELD_NUMBER: _ClassVar[int]
    settings: SessionSettings
    audio: bytes
    item: Message
    commit: Commit
    cancel: Cancel
    clear: Clear
    delete_item: DeleteItem
    truncate_item: TruncateItem
    def __init__(self, settings: _Optional[_Union[SessionSettings, _Mapping]] = ..., audio: _Optional[bytes] = ..., item: _Optional[_Union[Message, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., clear: _Optional[_Union[Clear, _Mapping]] = ..., delete_item: _Optional[_Union[DeleteItem, _Mapping]] = ..., truncate_item: _Optional[_Union[TruncateItem, _Mapping]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "settings")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    settings: SessionSettings
    def __init__(self, session_id: _Optional[str] = ..., settings: _Optional[_Union[SessionSettings, _Mapping]] = ...) -> None: ...

class SpeechStarted(_message.Message):
    __slots__ = ("audio_start_seconds", "item_id")
    AUDIO_START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    audio_start_seconds: float
    item_id: str
    def __init__(self, audio_start_seconds: _Optional[float] = ..., item_id: _Optional[str] = ...) -> None: ...

class SpeechStopped(_message.Message):
    __slots__ = ("audio_end_seconds", "item_id")
    AUDIO_END_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    audio_end_seconds: float
    item_id: str
    def __init__(self, audio_end_seconds: _Optional[float] = ..., item_id: _Optional[str] = ...) -> None: ...

class TurnCommitted(_message.Message):
    __slots__ = ("audio_seconds", "parts", "item_id")
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    audio_seconds: float
    parts: int
    item_id: str
    def __init__(self, audio_seconds: _Optional[float] = ..., parts: _Optional[int] = ..., item_id: _Optional[str] = ...) -> None: ...

class TurnStarted(_message.Message):
    __slots__ = ("item_id",)
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    def __init__(self, item_id: _Optional[str] = ...) -> None: ...

class TurnDone(_message.Message):
    __slots__ = ("status", "reason", "usage", "transcript")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    status: TurnStatus
    reason: FinishReason
    usage: Usage
    transcript: str
    def __init__(self, status: _Optional[_Union[TurnStatus, str]] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., transcript: _Optional[str] = ...) -> None: ...

class HistoryTruncated(_message.Message):
    __slots__ = ("turns_dropped", "tokens_dropped", "turns_kept")
    TURNS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TURNS_KEPT_FIELD_NUMBER: _ClassVar[int]
    turns_dropped: int
    tokens_dropped: int
    turns_kept: int
    def __init__(self, turns_dropped: _Optional[int] = ..., tokens_dropped: _Optional[int] = ..., turns_kept: _Optional[int] = ...) -> None: ...

class InputCleared(_message.Message):
    __slots__ = ("history",)
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    history: bool
    def __init__(self, history: _Optional[bool] = ...) -> None: ...

class ItemDeleted(_message.Message):
    __slots__ = ("item_id",)
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    def __init__(self, item_id: _Optional[str] = ...) -> None: ...

class ItemTruncated(_message.Message):
    __slots__ = ("item_id", "audio_end_seconds", "transcript")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_END_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    audio_end_seconds: float
    transcript: str
    def __init__(self, item_id: _Optional[str] = ..., audio_end_seconds: _Optional[float] = ..., transcript: _Optional[str] = ...) -> None: ...

class ConverseError(_message.Message):
    __slots__ = ("code", "message", "event")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    event: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., event: _Optional[str] = ...) -> None: ...

class ConverseResponse(_message.Message):
    __slots__ = ("turn_id", "session", "speech_started", "speech_stopped", "committed", "started", "text", "audio", "done", "truncated", "cleared", "error", "item_deleted", "item_truncated")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SPEECH_STARTED_FIELD_NUMBER: _ClassVar[int]
    SPEECH_STOPPED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ITEM_DELETED_FIELD_NUMBER: _ClassVar[int]
    ITEM_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    session: SessionInfo
    speech_started: SpeechStarted
    speech_stopped: SpeechStopped
    committed: TurnCommitted
    started: TurnStarted
    text: TextDelta
    audio: AudioChunk
    done: TurnDone
    truncated: HistoryTruncated
    cleared: InputCleared
    error: ConverseError
    item_deleted: ItemDeleted
    item_truncated: ItemTruncated
    def __init__(self, turn_id: _Optional[str] = ..., session: _Optional[_Union[SessionInfo, _Mapping]] = ..., speech_started: _Optional[_Union[SpeechStarted, _Mapping]] = ..., speech_stopped: _Optional[_Union[SpeechStopped, _Mapping]] = ..., committed: _Optional[_Union[TurnCommitted, _Mapping]] = ..., started: _Optional[_Union[TurnStarted, _Mapping]] = ..., text: _Optional[_Union[TextDelta, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., done: _Optional[_Union[TurnDone, _Mapping]] = ..., truncated: _Optional[_Union[HistoryTruncated, _Mapping]] = ..., cleared: _Optional[_Union[InputCleared, _Mapping]] = ..., error: _Optional[_Union[ConverseError, _Mapping]] = ..., item_deleted: _Optional[_Union[ItemDeleted, _Mapping]] = ..., item_truncated: _Optional[_Union[ItemTruncated, _Mapping]] = ...) -> None: ...
