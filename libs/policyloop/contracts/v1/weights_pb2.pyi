from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PayloadKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_KIND_UNSPECIFIED: _ClassVar[PayloadKind]
    PAYLOAD_KIND_KEYFRAME: _ClassVar[PayloadKind]
    PAYLOAD_KIND_DELTA: _ClassVar[PayloadKind]
PAYLOAD_KIND_UNSPECIFIED: PayloadKind
PAYLOAD_KIND_KEYFRAME: PayloadKind
PAYLOAD_KIND_DELTA: PayloadKind

class PushHeader(_message.Message):
    __slots__ = ("model", "version", "step", "codec", "total_bytes", "payload_xxh3_128", "run_id", "trained_unix_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_XXH3_128_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    step: int
    codec: str
    total_bytes: int
    payload_xxh3_128: str
    run_id: str
    trained_unix_ms: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., codec: _Optional[str] = ..., total_bytes: _Optional[int] = ..., payload_xxh3_128: _Optional[str] = ..., run_id: _Optional[str] = ..., trained_unix_ms: _Optional[int] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("model", "version", "bytes_stored")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    bytes_stored: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., bytes_stored: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model", "have_version", "want_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WANT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    have_version: int
    want_version: int
    def __init__(self, model: _Optional[str] = ..., have_version: _Optional[int] = ..., want_version: _Optional[int] = ...) -> None: ...

class FetchHeader(_message.Message):
    __slots__ = ("model", "version", "base_version", "kind", "codec", "total_bytes", "payload_xxh3_128", "manifest_hash")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_XXH3_128_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    base_version: int
    kind: PayloadKind
    codec: str
    total_bytes: int
    payload_xxh3_128: str
    manifest_hash: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., kind: _Optional[_Union[PayloadKind, str]] = ..., codec: _Optional[str] = ..., total_bytes: _Optional[int] = ..., payload_xxh3_128: _Optional[str] = ..., manifest_hash: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FetchHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[FetchHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("model", "version", "step", "codec", "bytes", "payload_xxh3_128", "created_unix_ms", "kind", "base_version", "manifest_hash", "trained_unix_ms", "kept")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_XXH3_128_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    TRAINED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    step: int
    codec: str
    bytes: int
    payload_xxh3_128: str
    created_unix_ms: int
    kind: PayloadKind
    base_version: int
    manifest_hash: str
    trained_unix_ms: int
    kept: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., codec: _Optional[str] = ..., bytes: _Optional[int] = ..., payload_xxh3_128: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., kind: _Optional[_Union[PayloadKind, str]] = ..., base_version: _Optional[int] = ..., manifest_hash: _Optional[str] = ..., trained_unix_ms: _Optional[int] = ..., kept: _Optional[bool] = ...) -> None: ...

class KeepVersionRequest(_message.Message):
    __slots__ = ("model", "version", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    reason: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ...) -> None: ...

class JoinTreeRequest(_message.Message):
    __slots__ = ("model", "replica", "relay_endpoint", "node", "zone", "failed_parent")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RELAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    FAILED_PARENT_FIELD_NUMBER: _ClassVar[int]
    model: str
    replica: str
    relay_endpoint: str
    node: str
    zone: str
    failed_parent: str
    def __init__(self, model: _Optional[str] = ..., replica: _Optional[str] = ..., relay_endpoint: _Optional[str] = ..., node: _Optional[str] = ..., zone: _Optional[str] = ..., failed_parent: _Optional[str] = ...) -> None: ...

class TreePlacement(_message.Message):
    __slots__ = ("parent", "parent_endpoint", "depth", "fanout", "lease_s")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    parent: str
    parent_endpoint: str
    depth: int
    fanout: int
    lease_s: float
    def __init__(self, parent: _Optional[str] = ..., parent_endpoint: _Optional[str] = ..., depth: _Optional[int] = ..., fanout: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...
