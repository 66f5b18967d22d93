from omni.stage.v1 import common_pb2 as _common_pb2
from omni.stage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_EOS: _ClassVar[StopReason]
    STOP_REASON_LENGTH: _ClassVar[StopReason]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_EOS: StopReason
STOP_REASON_LENGTH: StopReason

class MultimodalSpan(_message.Message):
    __slots__ = ("offset", "embeds", "deepstack", "runs")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    DEEPSTACK_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    embeds: _tensor_pb2.TensorRef
    deepstack: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorRef]
    runs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., embeds: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., deepstack: _Optional[_Iterable[_Union[_tensor_pb2.TensorRef, _Mapping]]] = ..., runs: _Optional[_Iterable[int]] = ...) -> None: ...

class ThinkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "positions", "rope_delta", "spans", "sampling", "return_states", "placement", "embed_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_STATES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    EMBED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[float]
    rope_delta: float
    spans: _containers.RepeatedCompositeFieldContainer[MultimodalSpan]
    sampling: _common_pb2.Sampling
    return_states: bool
    placement: _tensor_pb2.Placement
    embed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[float]] = ..., rope_delta: _Optional[float] = ..., spans: _Optional[_Iterable[_Union[MultimodalSpan, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., return_states: _Optional[bool] = ..., placement: _Optional[_Union[_tensor_pb2.Placement, _Mapping]] = ..., embed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ThinkerOutput(_message.Message):
    __slots__ = ("token_ids", "state_start", "states", "stop_reason", "prompt_tokens", "timings", "token_embeds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_START_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    state_start: int
    states: _tensor_pb2.TensorRef
    stop_reason: StopReason
    prompt_tokens: int
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Timing]
    token_embeds: _tensor_pb2.TensorRef
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., state_start: _Optional[int] = ..., states: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., prompt_tokens: _Optional[int] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.Timing, _Mapping]]] = ..., token_embeds: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...
