from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Version(_message.Message):
    __slots__ = ("run", "step")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class WorkerHealth(_message.Message):
    __slots__ = ("rank", "state", "pid", "version", "has_version", "detail", "requests_served", "requests_by_version", "device", "memory")
    class RequestsByVersionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state: str
    pid: int
    version: Version
    has_version: bool
    detail: str
    requests_served: int
    requests_by_version: _containers.ScalarMap[str, int]
    device: str
    memory: _containers.ScalarMap[str, int]
    def __init__(self, rank: _Optional[int] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., version: _Optional[_Union[Version, _Mapping]] = ..., has_version: _Optional[bool] = ..., detail: _Optional[str] = ..., requests_served: _Optional[int] = ..., requests_by_version: _Optional[_Mapping[str, int]] = ..., device: _Optional[str] = ..., memory: _Optional[_Mapping[str, int]] = ...) -> None: ...

class UpdateProgress(_message.Message):
    __slots__ = ("phase", "bytes_done", "bytes_total", "version", "update_id", "detail")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    phase: str
    bytes_done: int
    bytes_total: int
    version: Version
    update_id: str
    detail: str
    def __init__(self, phase: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., version: _Optional[_Union[Version, _Mapping]] = ..., update_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class UpdateRecord(_message.Message):
    __slots__ = ("version", "ok", "seconds", "bytes", "verified", "verify_seconds", "error", "transfer_seconds", "method", "requests_during", "tensors", "deployment", "update_id", "note", "phase_seconds", "control_bytes", "max_control_message_bytes", "max_control_message")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_DURING_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTROL_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTROL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    version: Version
    ok: bool
    seconds: float
    bytes: int
    verified: bool
    verify_seconds: float
    error: str
    transfer_seconds: float
    method: str
    requests_during: int
    tensors: int
    deployment: str
    update_id: str
    note: str
    phase_seconds: _containers.ScalarMap[str, float]
    control_bytes: int
    max_control_message_bytes: int
    max_control_message: str
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ..., ok: _Optional[bool] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., verified: _Optional[bool] = ..., verify_seconds: _Optional[float] = ..., error: _Optional[str] = ..., transfer_seconds: _Optional[float] = ..., method: _Optional[str] = ..., requests_during: _Optional[int] = ..., tensors: _Optional[int] = ..., deployment: _Optional[str] = ..., update_id: _Optional[str] = ..., note: _Optional[str] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., control_bytes: _Optional[int] = ..., max_control_message_bytes: _Optional[int] = ..., max_control_message: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Status(_message.Message):
    __slots__ = ("role", "model", "version", "has_version", "serving_state", "update_in_progress", "progress", "last_error", "workers", "requests_served", "requests_during_updates", "history", "committed", "has_committed", "layout_fingerprint", "deployments", "needs_repair", "worker_address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_STATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_DURING_UPDATES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    HAS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_REPAIR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    version: Version
    has_version: bool
    serving_state: str
    update_in_progress: bool
    progress: UpdateProgress
    last_error: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerHealth]
    requests_served: int
    requests_during_updates: int
    history: _containers.RepeatedCompositeFieldContainer[UpdateRecord]
    committed: Version
    has_committed: bool
    layout_fingerprint: str
    deployments: _containers.RepeatedCompositeFieldContainer[DeploymentStatus]
    needs_repair: bool
    worker_address: str
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[_Union[Version, _Mapping]] = ..., has_version: _Optional[bool] = ..., serving_state: _Optional[str] = ..., update_in_progress: _Optional[bool] = ..., progress: _Optional[_Union[UpdateProgress, _Mapping]] = ..., last_error: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerHealth, _Mapping]]] = ..., requests_served: _Optional[int] = ..., requests_during_updates: _Optional[int] = ..., history: _Optional[_Iterable[_Union[UpdateRecord, _Mapping]]] = ..., committed: _Optional[_Union[Version, _Mapping]] = ..., has_committed: _Optional[bool] = ..., layout_fingerprint: _Optional[str] = ..., deployments: _Optional[_Iterable[_Union[DeploymentStatus, _Mapping]]] = ..., needs_repair: _Optional[bool] = ..., worker_address: _Optional[str] = ...) -> None: ...

class DeploymentStatus(_message.Message):
    __slots__ = ("address", "committed", "has_committed", "last_error", "phase", "backend")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    HAS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    address: str
    committed: Version
    has_committed: bool
    last_error: str
    phase: str
    backend: str
    def __init__(self, address: _Optional[str] = ..., committed: _Optional[_Union[Version, _Mapping]] = ..., has_committed: _Optional[bool] = ..., last_error: _Optional[str] = ..., phase: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("deployments",)
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, deployments: _Optional[_Iterable[str]] = ...) -> None: ...

class TriggerUpdateRequest(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class TriggerUpdateReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: Version
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ...) -> None: ...

class WaitForVersionRequest(_message.Message):
    __slots__ = ("version", "timeout_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    version: Version
    timeout_s: float
    def __init__(self, version: _Optional[_Union[Version, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class UpdateOutcome(_message.Message):
    __slots__ = ("ok", "committed", "superseded", "error", "record", "deployments")
    OK_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    committed: Version
    superseded: bool
    error: str
    record: UpdateRecord
    deployments: _containers.RepeatedCompositeFieldContainer[DeploymentStatus]
    def __init__(self, ok: _Optional[bool] = ..., committed: _Optional[_Union[Version, _Mapping]] = ..., superseded: _Optional[bool] = ..., error: _Optional[str] = ..., record: _Optional[_Union[UpdateRecord, _Mapping]] = ..., deployments: _Optional[_Iterable[_Union[DeploymentStatus, _Mapping]]] = ...) -> None: ...

class GetLayoutRequest(_message.Message):
    __slots__ = ("known_fingerprint", "acquire_epoch")
    KNOWN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    known_fingerprint: str
    acquire_epoch: bool
    def __init__(self, known_fingerprint: _Optional[str] = ..., acquire_epoch: _Optional[bool] = ...) -> None: ...

class LayoutReply(_message.Message):
    __slots__ = ("model", "layout", "fingerprint", "workers", "devices", "membership", "device_uuids", "epoch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    layout: bytes
    fingerprint: str
    workers: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    membership: str
    device_uuids: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    def __init__(self, model: _Optional[str] = ..., layout: _Optional[bytes] = ..., fingerprint: _Optional[str] = ..., workers: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., membership: _Optional[str] = ..., device_uuids: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "store_host", "store_port", "src_world", "dst_world", "transport", "nccl_unique_id", "key", "device_uuids")
    ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    SRC_WORLD_FIELD_NUMBER: _ClassVar[int]
    DST_WORLD_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    store_host: str
    store_port: int
    src_world: int
    dst_world: int
    transport: str
    nccl_unique_id: bytes
    key: str
    device_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., src_world: _Optional[int] = ..., dst_world: _Optional[int] = ..., transport: _Optional[str] = ..., nccl_unique_id: _Optional[bytes] = ..., key: _Optional[str] = ..., device_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class BeginUpdateRequest(_message.Message):
    __slots__ = ("update_id", "version", "src_layout", "plan_digest", "session", "timeout_s", "method", "bucket_bytes", "tensors", "epoch", "allow_rollback", "src_fingerprint")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SRC_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALLOW_ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SRC_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    version: Version
    src_layout: bytes
    plan_digest: str
    session: Session
    timeout_s: float
    method: str
    bucket_bytes: int
    tensors: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    allow_rollback: bool
    src_fingerprint: str
    def __init__(self, update_id: _Optional[str] = ..., version: _Optional[_Union[Version, _Mapping]] = ..., src_layout: _Optional[bytes] = ..., plan_digest: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., timeout_s: _Optional[float] = ..., method: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., allow_rollback: _Optional[bool] = ..., src_fingerprint: _Optional[str] = ...) -> None: ...

class BeginUpdateReply(_message.Message):
    __slots__ = ("bytes_total",)
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    bytes_total: int
    def __init__(self, bytes_total: _Optional[int] = ...) -> None: ...

class Checksums(_message.Message):
    __slots__ = ("plan_digest", "slots", "values")
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    plan_digest: str
    slots: bytes
    values: bytes
    def __init__(self, plan_digest: _Optional[str] = ..., slots: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class FinishUpdateRequest(_message.Message):
    __slots__ = ("update_id", "expected")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    expected: Checksums
    def __init__(self, update_id: _Optional[str] = ..., expected: _Optional[_Union[Checksums, _Mapping]] = ...) -> None: ...

class FinishUpdateReply(_message.Message):
    __slots__ = ("committed", "verify_seconds", "bytes", "requests_during", "commit_seconds")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_DURING_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    committed: Version
    verify_seconds: float
    bytes: int
    requests_during: int
    commit_seconds: float
    def __init__(self, committed: _Optional[_Union[Version, _Mapping]] = ..., verify_seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., requests_during: _Optional[int] = ..., commit_seconds: _Optional[float] = ...) -> None: ...

class AbortUpdateRequest(_message.Message):
    __slots__ = ("update_id", "reason", "version")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    reason: str
    version: Version
    def __init__(self, update_id: _Optional[str] = ..., reason: _Optional[str] = ..., version: _Optional[_Union[Version, _Mapping]] = ...) -> None: ...

class AbortUpdateReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DumpRequest(_message.Message):
    __slots__ = ("tensor", "rank")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    rank: int
    def __init__(self, tensor: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class DumpChunk(_message.Message):
    __slots__ = ("name", "shape", "dtype", "version", "offset", "data", "total_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    version: Version
    offset: int
    data: bytes
    total_bytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., version: _Optional[_Union[Version, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...
