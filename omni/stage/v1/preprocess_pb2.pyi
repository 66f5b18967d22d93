from omni.v1 import omni_pb2 as _omni_pb2
from omni.stage.v1 import common_pb2 as _common_pb2
from omni.stage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MediaItem(_message.Message):
    __slots__ = ("image", "audio", "video")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    image: _omni_pb2.Image
    audio: _omni_pb2.Audio
    video: _omni_pb2.Video
    def __init__(self, image: _Optional[_Union[_omni_pb2.Image, _Mapping]] = ..., audio: _Optional[_Union[_omni_pb2.Audio, _Mapping]] = ..., video: _Optional[_Union[_omni_pb2.Video, _Mapping]] = ...) -> None: ...

class PreprocessRequest(_message.Message):
    __slots__ = ("request_id", "items", "placement")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[MediaItem]
    placement: _tensor_pb2.Placement
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., placement: _Optional[_Union[_tensor_pb2.Placement, _Mapping]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("kind", "values", "grid_thw", "feature_length", "second_per_grid", "num_tokens", "with_audio", "exact_second_per_grid")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WITH_AUDIO_FIELD_NUMBER: _ClassVar[int]
    EXACT_SECOND_PER_GRID_FIELD_NUMBER: _ClassVar[int]
    kind: _common_pb2.MediaKind
    values: _tensor_pb2.TensorRef
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    feature_length: int
    second_per_grid: float
    num_tokens: int
    with_audio: bool
    exact_second_per_grid: float
    def __init__(self, kind: _Optional[_Union[_common_pb2.MediaKind, str]] = ..., values: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., feature_length: _Optional[int] = ..., second_per_grid: _Optional[float] = ..., num_tokens: _Optional[int] = ..., with_audio: _Optional[bool] = ..., exact_second_per_grid: _Optional[float] = ...) -> None: ...

class PreprocessResponse(_message.Message):
    __slots__ = ("items", "timings")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Features]
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Timing]
    def __init__(self, items: _Optional[_Iterable[_Union[Features, _Mapping]]] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.Timing, _Mapping]]] = ...) -> None: ...
