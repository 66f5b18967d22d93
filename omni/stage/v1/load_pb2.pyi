from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("stage", "replica", "in_flight", "queued", "active", "kv_used")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    KV_USED_FIELD_NUMBER: _ClassVar[int]
    stage: str
    replica: int
    in_flight: int
    queued: int
    active: int
    kv_used: float
    def __init__(self, stage: _Optional[str] = ..., replica: _Optional[int] = ..., in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., active: _Optional[int] = ..., kv_used: _Optional[float] = ...) -> None: ...
