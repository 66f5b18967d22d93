from omni.stage.v1 import common_pb2 as _common_pb2
from omni.stage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TalkerStart(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "layout", "voice", "sampling", "tts_embeds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TTS_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: _common_pb2.MediaLayout
    voice: str
    sampling: _common_pb2.Sampling
    tts_embeds: _tensor_pb2.TensorRef
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[_common_pb2.MediaLayout, _Mapping]] = ..., voice: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., tts_embeds: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...

class ThinkerStates(_message.Message):
    __slots__ = ("start", "states")
    START_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    start: int
    states: _tensor_pb2.TensorRef
    def __init__(self, start: _Optional[int] = ..., states: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...

class TextEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TalkerInput(_message.Message):
    __slots__ = ("start", "states", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: TalkerStart
    states: ThinkerStates
    end: TextEnd
    def __init__(self, start: _Optional[_Union[TalkerStart, _Mapping]] = ..., states: _Optional[_Union[ThinkerStates, _Mapping]] = ..., end: _Optional[_Union[TextEnd, _Mapping]] = ...) -> None: ...

class SpeechChunk(_message.Message):
    __slots__ = ("pcm", "sample_rate", "codes", "num_codebooks", "first_frame")
    PCM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    pcm: bytes
    sample_rate: int
    codes: _containers.RepeatedScalarFieldContainer[int]
    num_codebooks: int
    first_frame: int
    def __init__(self, pcm: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., codes: _Optional[_Iterable[int]] = ..., num_codebooks: _Optional[int] = ..., first_frame: _Optional[int] = ...) -> None: ...

class TalkerFinished(_message.Message):
    __slots__ = ("frames", "eos", "timings")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    EOS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    frames: int
    eos: bool
    timings: _containers.RepeatedCompositeFieldContainer[_common_pb2.Timing]
    def __init__(self, frames: _Optional[int] = ..., eos: _Optional[bool] = ..., timings: _Optional[_Iterable[_Union[_common_pb2.Timing, _Mapping]]] = ...) -> None: ...

class TalkerOutput(_message.Message):
    __slots__ = ("chunk", "finished")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    chunk: SpeechChunk
    finished: TalkerFinished
    def __init__(self, chunk: _Optional[_Union[SpeechChunk, _Mapping]] = ..., finished: _Optional[_Union[TalkerFinished, _Mapping]] = ...) -> None: ...
