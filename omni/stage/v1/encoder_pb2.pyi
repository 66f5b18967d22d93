from omni.stage.v1 import common_pb2 as _common_pb2
from omni.stage.v1 import preprocess_pb2 as _preprocess_pb2
from omni.stage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "placement")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[_preprocess_pb2.Features]
    placement: _tensor_pb2.Placement
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[_preprocess_pb2.Features, _Mapping]]] = ..., placement: _Optional[_Union[_tensor_pb2.Placement, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("kind", "embeds", "deepstack")
    KIND_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    DEEPSTACK_FIELD_NUMBER: _ClassVar[int]
    kind: _common_pb2.MediaKind
    embeds: _tensor_pb2.TensorRef
    deepstack: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorRef]
    def __init__(self, kind: _Optional[_Union[_common_pb2.MediaKind, str]] = ..., embeds: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., deepstack: _Optional[_Iterable[_Union[_tensor_pb2.TensorRef, _Mapping]]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items", "timings")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Embedding]
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Timing]
    def __init__(self, items: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.Timing, _Mapping]]] = ...) -> None: ...
