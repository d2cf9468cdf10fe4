from reshard.proto import reshard_pb2 as _reshard_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("rank", "world", "pid", "rank_layout", "model", "version", "has_version", "role", "device", "device_uuid", "instance", "staging")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world: int
    pid: int
    rank_layout: bytes
    model: str
    version: _reshard_pb2.Version
    has_version: bool
    role: str
    device: str
    device_uuid: str
    instance: bytes
    staging: str
    def __init__(self, rank: _Optional[int] = ..., world: _Optional[int] = ..., pid: _Optional[int] = ..., rank_layout: _Optional[bytes] = ..., model: _Optional[str] = ..., version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ..., has_version: _Optional[bool] = ..., role: _Optional[str] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., instance: _Optional[bytes] = ..., staging: _Optional[str] = ...) -> None: ...

class Prepare(_message.Message):
    __slots__ = ("update_id", "version", "src_layout", "dst_layout", "plan_digest", "session", "timeout_s", "method", "bucket_bytes", "tensors", "src_fingerprint", "dst_fingerprint")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SRC_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SRC_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    version: _reshard_pb2.Version
    src_layout: bytes
    dst_layout: bytes
    plan_digest: str
    session: _reshard_pb2.Session
    timeout_s: float
    method: str
    bucket_bytes: int
    tensors: _containers.RepeatedScalarFieldContainer[str]
    src_fingerprint: str
    dst_fingerprint: str
    def __init__(self, update_id: _Optional[str] = ..., version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ..., src_layout: _Optional[bytes] = ..., dst_layout: _Optional[bytes] = ..., plan_digest: _Optional[str] = ..., session: _Optional[_Union[_reshard_pb2.Session, _Mapping]] = ..., timeout_s: _Optional[float] = ..., method: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[str]] = ..., src_fingerprint: _Optional[str] = ..., dst_fingerprint: _Optional[str] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("update_id", "expected")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    expected: _reshard_pb2.Checksums
    def __init__(self, update_id: _Optional[str] = ..., expected: _Optional[_Union[_reshard_pb2.Checksums, _Mapping]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("update_id", "version")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    version: _reshard_pb2.Version
    def __init__(self, update_id: _Optional[str] = ..., version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("update_id", "reason", "version")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    reason: str
    version: _reshard_pb2.Version
    def __init__(self, update_id: _Optional[str] = ..., reason: _Optional[str] = ..., version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ...) -> None: ...

class Read(_message.Message):
    __slots__ = ("tensor", "offset", "size")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    offset: _containers.RepeatedScalarFieldContainer[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[_Iterable[int]] = ..., size: _Optional[_Iterable[int]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: _reshard_pb2.Version
    def __init__(self, version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("version", "has_outcome", "ok", "error", "delivered")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    version: _reshard_pb2.Version
    has_outcome: bool
    ok: bool
    error: str
    delivered: _reshard_pb2.Version
    def __init__(self, version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ..., has_outcome: _Optional[bool] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., delivered: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ...) -> None: ...

class NcclUniqueId(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("name", "device", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "dtype", "shape", "stride", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaIpcHandles(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[CudaIpcHandle]
    def __init__(self, handles: _Optional[_Iterable[_Union[CudaIpcHandle, _Mapping]]] = ...) -> None: ...

class Serve(_message.Message):
    __slots__ = ("allow", "reason")
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    allow: bool
    reason: str
    def __init__(self, allow: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("id", "prepare", "verify", "commit", "abort", "read", "step", "nccl_unique_id", "release", "serve", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SERVE_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    id: int
    prepare: Prepare
    verify: Verify
    commit: Commit
    abort: Abort
    read: Read
    step: Step
    nccl_unique_id: NcclUniqueId
    release: Release
    serve: Serve
    trace: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[int] = ..., prepare: _Optional[_Union[Prepare, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., read: _Optional[_Union[Read, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., nccl_unique_id: _Optional[_Union[NcclUniqueId, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., serve: _Optional[_Union[Serve, _Mapping]] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("id", "ok", "error", "seconds", "bytes_total", "nccl_unique_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    ok: bool
    error: str
    seconds: float
    bytes_total: int
    nccl_unique_id: bytes
    def __init__(self, id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., bytes_total: _Optional[int] = ..., nccl_unique_id: _Optional[bytes] = ...) -> None: ...

class ReadPiece(_message.Message):
    __slots__ = ("id", "offset", "size", "byte_offset", "data", "last", "version")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    id: int
    offset: _containers.RepeatedScalarFieldContainer[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    byte_offset: int
    data: bytes
    last: bool
    version: _reshard_pb2.Version
    def __init__(self, id: _Optional[int] = ..., offset: _Optional[_Iterable[int]] = ..., size: _Optional[_Iterable[int]] = ..., byte_offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("update_id", "bytes_done", "bytes_total", "connected", "connect_seconds")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CONNECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    bytes_done: int
    bytes_total: int
    connected: bool
    connect_seconds: float
    def __init__(self, update_id: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., connected: _Optional[bool] = ..., connect_seconds: _Optional[float] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("update_id", "ok", "error", "checksums", "bytes", "seconds", "checksum_seconds", "memory")
    class MemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    ok: bool
    error: str
    checksums: _reshard_pb2.Checksums
    bytes: int
    seconds: float
    checksum_seconds: float
    memory: _containers.ScalarMap[str, int]
    def __init__(self, update_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., checksums: _Optional[_Union[_reshard_pb2.Checksums, _Mapping]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., checksum_seconds: _Optional[float] = ..., memory: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Published(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: _reshard_pb2.Version
    def __init__(self, version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("requests_served", "version", "has_version", "requests_during_update", "requests_by_version", "held")
    class RequestsByVersionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_DURING_UPDATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    requests_served: int
    version: _reshard_pb2.Version
    has_version: bool
    requests_during_update: int
    requests_by_version: _containers.ScalarMap[str, int]
    held: bool
    def __init__(self, requests_served: _Optional[int] = ..., version: _Optional[_Union[_reshard_pb2.Version, _Mapping]] = ..., has_version: _Optional[bool] = ..., requests_during_update: _Optional[int] = ..., requests_by_version: _Optional[_Mapping[str, int]] = ..., held: _Optional[bool] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "reply", "piece", "progress", "done", "published", "heartbeat")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    reply: Reply
    piece: ReadPiece
    progress: Progress
    done: TransferDone
    published: Published
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., reply: _Optional[_Union[Reply, _Mapping]] = ..., piece: _Optional[_Union[ReadPiece, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., done: _Optional[_Union[TransferDone, _Mapping]] = ..., published: _Optional[_Union[Published, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...
