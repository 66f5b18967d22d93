from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class MediaKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIA_KIND_UNSPECIFIED: _ClassVar[MediaKind]
    MEDIA_KIND_IMAGE: _ClassVar[MediaKind]
    MEDIA_KIND_AUDIO: _ClassVar[MediaKind]
    MEDIA_KIND_VIDEO: _ClassVar[MediaKind]
MEDIA_KIND_UNSPECIFIED: MediaKind
MEDIA_KIND_IMAGE: MediaKind
MEDIA_KIND_AUDIO: MediaKind
MEDIA_KIND_VIDEO: MediaKind

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed", "ignore_eos", "repetition_penalty", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    min_tokens: int
    seed: int
    ignore_eos: bool
    repetition_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("stage", "seconds")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    seconds: float
    def __init__(self, stage: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class MediaLayout(_message.Message):
    __slots__ = ("image_grid_thw", "video_grid_thw", "video_second_per_grid", "audio_feature_lengths")
    IMAGE_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    VIDEO_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    VIDEO_SECOND_PER_GRID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FEATURE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    image_grid_thw: _containers.RepeatedScalarFieldContainer[int]
    video_grid_thw: _containers.RepeatedScalarFieldContainer[int]
    video_second_per_grid: _containers.RepeatedScalarFieldContainer[float]
    audio_feature_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, image_grid_thw: _Optional[_Iterable[int]] = ..., video_grid_thw: _Optional[_Iterable[int]] = ..., video_second_per_grid: _Optional[_Iterable[float]] = ..., audio_feature_lengths: _Optional[_Iterable[int]] = ...) -> None: ...
