"""A ctypes binding to libnccl: the few calls the data plane needs, declared as a table.

Which library is loaded (first match wins; the choice and its reason are logged):

1. `RESHARD_NCCL_LIBRARY`, a path to a libnccl.so (an explicit choice, never second-guessed);
2. the nvidia-nccl-cu12 / nvidia-nccl-cu13 wheel matching torch's CUDA major version;
3. torch's own libnccl, where a torch build ships it as a separate file;
4. an NCCL wheel of the other CUDA major (logged as a mismatch);
5. the system's libnccl.so.2 (known library directories, then the dynamic loader's search).

`choose_library` makes that choice from plain inputs (environment, torch's CUDA version,
site directories) so tests run it on fake directory trees; `load_library` applies it to
this process. Nothing here needs a GPU until a communicator is created: the version and
`ncclGetUniqueId` work on any machine that has the library.

`ncclConfig_t` is versioned and append-only: NCCL reads `size`, `magic` and `version` first
and then only the fields that version declares. `config_struct(version)` builds the layout
a program compiled against that version's `nccl.h` would pass (fields checked against the
headers of every nvidia-nccl-cu12 wheel from 2.16.5 to 2.32.3).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.metadata
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence

from reshard.common.dataplane.transport import TransportError

log = logging.getLogger("reshard.nccl")

ENV_LIBRARY = "RESHARD_NCCL_LIBRARY"
SONAME = "libnccl.so.2"
WHEELS = {12: "nvidia-nccl-cu12", 13: "nvidia-nccl-cu13"}

# -- types of nccl.h --------------------------------------------------------------------------
ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p

NCCL_UNIQUE_ID_BYTES = 128
NCCL_API_MAGIC = 0xCAFEBEEF
NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
ncclUint8 = 1  # ncclDataType_t: the data plane moves raw bytes
NCCL_SPLIT_NOCOLOR = -1  # ncclCommSplit's color of a rank that joins no new communicator

RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}
ncclSuccess, ncclInProgress = 0, 7


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        return bytes(self.internal)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ncclUniqueId":
        if len(data) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}")
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), data, NCCL_UNIQUE_ID_BYTES)
        return uid


# -- versions ---------------------------------------------------------------------------------
def version_code(major: int, minor: int, patch: int) -> int:
    """NCCL_VERSION(X, Y, Z): releases up to 2.8 used X*1000 + Y*100 + Z."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def decode_version(code: int) -> tuple[int, int, int]:
    """The inverse of `version_code`: 22304 -> (2, 23, 4), 2304 -> (2, 3, 4)."""
    if code < 0:
        raise ValueError(f"invalid NCCL version code {code}")
    if code < 10000:
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


def version_string(code: int) -> str:
    return ".".join(map(str, decode_version(code)))


# -- ncclConfig_t -----------------------------------------------------------------------------
_int, _ptr = ctypes.c_int, ctypes.c_void_p
# (first release that has the field, name, C type), in declaration order after size/magic/version.
CONFIG_FIELDS: tuple[tuple[int, str, type], ...] = (
    (21400, "blocking", _int),
    (21700, "cgaClusterSize", _int),
    (21700, "minCTAs", _int),
    (21700, "maxCTAs", _int),
    (21700, "netName", _ptr),
    (21800, "splitShare", _int),
    (22600, "trafficClass", _int),
    (22700, "commName", _ptr),
    (22700, "collnetEnable", _int),
    (22700, "CTAPolicy", _int),
    (22700, "shrinkShare", _int),
    (22700, "nvlsCTAs", _int),
    (22800, "nChannelsPerNetPeer", _int),
    (22800, "nvlinkCentricSched", _int),
    (22900, "graphUsageMode", _int),
    (22900, "numRmaCtx", _int),
    (23000, "maxP2pPeers", _int),
    (23000, "graphStreamOrdering", _int),
    (23100, "launchOrderImplicit", _int),
    (23100, "numRmaSig", _int),
    (23100, "rmaEagerInit", _int),
    (23100, "hostCftMode", _int),
    (23200, "nvlsHostMode", _int),
)
CONFIG_MIN_VERSION = 21400  # ncclCommInitRankConfig and non-blocking communicators
CONFIG_NEWEST_KNOWN = 23203  # the newest nccl.h the table was checked against


@functools.lru_cache(maxsize=None)
def config_struct(version: int) -> type[ctypes.Structure]:
    """The ncclConfig_t layout of NCCL `version` (a version code, e.g. 22304)."""
    if version < CONFIG_MIN_VERSION:
        raise ValueError(f"NCCL {version_string(version)} has no ncclConfig_t (needs 2.14 or newer)")
    fields = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint)]
    fields += [(name, ctype) for since, name, ctype in CONFIG_FIELDS if since <= version]
    return type(f"ncclConfig_v{version}", (ctypes.Structure,), {"_fields_": fields})


def make_config(version: int, **values: int) -> ctypes.Structure:
    """A config as NCCL_CONFIG_INITIALIZER would make it for that version's header, with `values` set."""
    header = min(version, CONFIG_NEWEST_KNOWN)
    cls = config_struct(header)
    cfg = cls()
    cfg.size, cfg.magic, cfg.version = ctypes.sizeof(cls), NCCL_API_MAGIC, header
    names = {n for n, _ in cls._fields_}
    for _, name, ctype in CONFIG_FIELDS:
        if name in names and ctype is _int:
            setattr(cfg, name, NCCL_CONFIG_UNDEF_INT)  # pointers are already NULL (NCCL_CONFIG_UNDEF_PTR)
    for name, value in values.items():
        if name not in names:
            raise ValueError(f"ncclConfig_t of NCCL {version_string(version)} has no field {name!r}")
        setattr(cfg, name, value)
    return cfg


# -- errors -----------------------------------------------------------------------------------
class NcclError(TransportError):
    """A libnccl call returned an error (the code's name and NCCL's own description)."""

    def __init__(self, call: str, code: int, text: str = "", detail: str = "") -> None:
        self.call, self.code = call, code
        self.code_name = RESULT_NAMES.get(code, f"ncclResult {code}")
        self.text = text
        msg = f"{call} failed: {self.code_name} ({code})" + (f": {text}" if text else "")
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class NcclUnavailable(RuntimeError):
    """No usable libnccl: the message lists where it was looked for."""


# -- the function table -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Function:
    name: str
    restype: object
    argtypes: tuple
    required: bool = True


FUNCTIONS: tuple[Function, ...] = (
    # ncclResult_t ncclGetVersion(int *version);
    Function("ncclGetVersion", ncclResult_t, (ctypes.POINTER(ctypes.c_int),)),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    Function("ncclGetUniqueId", ncclResult_t, (ctypes.POINTER(ncclUniqueId),)),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);
    # (the config is passed by address: its layout depends on the loaded version)
    Function("ncclCommInitRankConfig", ncclResult_t,
             (ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int, ctypes.c_void_p), required=False),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    Function("ncclCommInitRank", ncclResult_t, (ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int)),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
    Function("ncclCommGetAsyncError", ncclResult_t, (ncclComm_t, ctypes.POINTER(ncclResult_t))),
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    Function("ncclCommAbort", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommFinalize(ncclComm_t comm);
    Function("ncclCommFinalize", ncclResult_t, (ncclComm_t,), required=False),
    # ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
    # (NCCL 2.18 and newer; a NULL config: the new communicator inherits the parent's, non-blocking included)
    Function("ncclCommSplit", ncclResult_t,
             (ncclComm_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ncclComm_t), ctypes.c_void_p), required=False),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    Function("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
    Function("ncclSend", ncclResult_t, (buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream);
    Function("ncclRecv", ncclResult_t, (buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    Function("ncclBroadcast", ncclResult_t,
             (buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclGroupStart();
    Function("ncclGroupStart", ncclResult_t, ()),
    # ncclResult_t ncclGroupEnd();
    Function("ncclGroupEnd", ncclResult_t, ()),
    # const char* ncclGetErrorString(ncclResult_t result);
    Function("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    # const char* ncclGetLastError(ncclComm_t comm);
    Function("ncclGetLastError", ctypes.c_char_p, (ncclComm_t,), required=False),
)


class NcclLibrary:
    """A loaded libnccl with the table's functions bound. One per process and path (`load_library`)."""

    def __init__(self, path: str, reason: str = "") -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise NcclUnavailable(f"cannot load {path}: {e}") from e
        self.path, self.reason = path, reason
        self._fns: dict[str, object] = {}
        for f in FUNCTIONS:
            try:
                fn = getattr(self._lib, f.name)
            except AttributeError:
                if f.required:
                    raise NcclUnavailable(f"{path} has no {f.name}: not an NCCL library, or a very old one") from None
                continue
            fn.restype, fn.argtypes = f.restype, list(f.argtypes)
            self._fns[f.name] = fn
        v = ctypes.c_int()
        self.check(self._fns["ncclGetVersion"](ctypes.byref(v)), "ncclGetVersion")
        self.version_code = v.value
        self.version = version_string(v.value)

    def has(self, name: str) -> bool:
        return name in self._fns

    def error_string(self, code: int) -> str:
        s = self._fns["ncclGetErrorString"](code)
        return s.decode(errors="replace") if s else ""

    def last_error(self, comm=None) -> str:
        if "ncclGetLastError" not in self._fns:
            return ""
        s = self._fns["ncclGetLastError"](comm)
        return s.decode(errors="replace") if s else ""

    def check(self, code: int, call: str, *, in_progress_ok: bool = False, comm=None) -> int:
        """Raise NcclError for a failed call; return the code (ncclSuccess, or ncclInProgress if allowed)."""
        if code == ncclSuccess or (in_progress_ok and code == ncclInProgress):
            return code
        text = self.error_string(code) if "ncclGetErrorString" in self._fns else ""
        raise NcclError(call, code, text, self.last_error(comm))

    # -- calls ------------------------------------------------------------------------------
    def unique_id(self) -> bytes:
        uid = ncclUniqueId()
        self.check(self._fns["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return uid.to_bytes()

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, *, blocking: bool = False):
        """Start creating a communicator. Non-blocking (the default) returns at once: poll
        `comm_async_error` until it is no longer ncclInProgress."""
        comm = ncclComm_t()
        uid = ncclUniqueId.from_bytes(unique_id)
        if "ncclCommInitRankConfig" in self._fns and self.version_code >= CONFIG_MIN_VERSION:
            cfg = make_config(self.version_code, blocking=1 if blocking else 0)
            call, code = "ncclCommInitRankConfig", self._fns["ncclCommInitRankConfig"](
                ctypes.byref(comm), nranks, uid, rank, ctypes.addressof(cfg))
        else:
            if not blocking:
                raise NcclUnavailable(f"NCCL {self.version} has no non-blocking init (needs 2.14 or newer)")
            call, code = "ncclCommInitRank", self._fns["ncclCommInitRank"](ctypes.byref(comm), nranks, uid, rank)
        try:
            self.check(code, call, in_progress_ok=True)
        except NcclError:
            if comm.value:  # a half-made communicator: free what it holds
                self._fns["ncclCommAbort"](comm)
            raise
        return comm

    def comm_async_error(self, comm) -> int:
        err = ncclResult_t()
        self.check(self._fns["ncclCommGetAsyncError"](comm, ctypes.byref(err)), "ncclCommGetAsyncError")
        return err.value

    def comm_abort(self, comm) -> None:
        self.check(self._fns["ncclCommAbort"](comm), "ncclCommAbort", in_progress_ok=True)

    def comm_split(self, comm, color: int, key: int):
        """Start splitting `comm` (collective over all its ranks). Returns the new handle's ctypes box:
        NCCL fills it in once the parent is no longer ncclInProgress (keep the box alive until then);
        it stays NULL on a rank that passed NCCL_SPLIT_NOCOLOR."""
        box = ncclComm_t()
        self.check(self._fns["ncclCommSplit"](comm, color, key, ctypes.byref(box), None), "ncclCommSplit",
                   in_progress_ok=True, comm=comm)
        return box

    def comm_finalize(self, comm) -> int:
        return self.check(self._fns["ncclCommFinalize"](comm), "ncclCommFinalize", in_progress_ok=True, comm=comm)

    def comm_destroy(self, comm) -> None:
        self.check(self._fns["ncclCommDestroy"](comm), "ncclCommDestroy", in_progress_ok=True)

    def send(self, ptr: int, nbytes: int, peer: int, comm, stream: int) -> int:
        return self.check(self._fns["ncclSend"](ptr, nbytes, ncclUint8, peer, comm, stream), "ncclSend",
                          in_progress_ok=True, comm=comm)

    def recv(self, ptr: int, nbytes: int, peer: int, comm, stream: int) -> int:
        return self.check(self._fns["ncclRecv"](ptr, nbytes, ncclUint8, peer, comm, stream), "ncclRecv",
                          in_progress_ok=True, comm=comm)

    def broadcast(self, send_ptr: int, recv_ptr: int, nbytes: int, root: int, comm, stream: int) -> int:
        return self.check(self._fns["ncclBroadcast"](send_ptr, recv_ptr, nbytes, ncclUint8, root, comm, stream),
                          "ncclBroadcast", in_progress_ok=True, comm=comm)

    def group_start(self) -> None:
        self.check(self._fns["ncclGroupStart"](), "ncclGroupStart")

    def group_end(self) -> int:
        return self.check(self._fns["ncclGroupEnd"](), "ncclGroupEnd", in_progress_ok=True)


# -- which library ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LibraryChoice:
    path: str
    """What to dlopen: a file path, or the bare soname for the dynamic loader's own search."""
    source: str
    """env | wheel | torch | system"""
    reason: str
    """Why this one, in words (logged, and shown by `reshard doctor`)."""
    exists: bool = True
    """False only for the last resort: a bare soname the dynamic loader may or may not find."""


def cuda_major(torch_cuda: str | None) -> int | None:
    """'12.8' -> 12; None (a CPU build of torch) -> None."""
    if not torch_cuda:
        return None
    try:
        return int(str(torch_cuda).split(".")[0])
    except ValueError:
        return None


def nccl_wheels(site_dirs: Iterable[str]) -> dict[int, tuple[str, str]]:
    """Installed NCCL wheels in `site_dirs`: CUDA major -> (libnccl path, wheel version).
    Found through the wheels' own file records (importlib.metadata), first site dir first."""
    found: dict[int, tuple[str, str]] = {}
    wanted = {name: major for major, name in WHEELS.items()}
    for dist in importlib.metadata.distributions(path=list(site_dirs)):
        major = wanted.get((dist.metadata["Name"] or "").lower().replace("_", "-"))
        if major is None or major in found:
            continue
        for f in dist.files or ():
            if f.name == SONAME:
                path = str(dist.locate_file(f))
                if os.path.isfile(path):
                    found[major] = (path, dist.version)
                    break
    return found


def torch_nccl(torch_lib_dir: str | None) -> str | None:
    """torch's own libnccl, for builds that ship it as a separate file (most link it statically)."""
    if not torch_lib_dir or not os.path.isdir(torch_lib_dir):
        return None
    for name in sorted(os.listdir(torch_lib_dir)):
        if name.startswith("libnccl") and ".so" in name:
            return os.path.join(torch_lib_dir, name)
    return None


DEFAULT_SYSTEM_DIRS = ("/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                       "/usr/lib64", "/usr/local/lib", "/usr/lib")


def choose_library(*, env: Mapping[str, str], torch_cuda: str | None, site_dirs: Sequence[str],
                   torch_lib_dir: str | None = None, system_dirs: Sequence[str] = DEFAULT_SYSTEM_DIRS) -> LibraryChoice:
    """Which libnccl to load, from plain inputs (pure but for looking at the given directories)."""
    override = env.get(ENV_LIBRARY, "").strip()
    if override:
        if not os.path.isfile(override):
            raise NcclUnavailable(f"{ENV_LIBRARY}={override} is not a file; point it at a libnccl.so.2 or unset it")
        return LibraryChoice(path=override, source="env", reason=f"{ENV_LIBRARY} is set")
    major = cuda_major(torch_cuda)
    wheels = nccl_wheels(site_dirs)
    if major is not None and major in wheels:
        path, v = wheels[major]
        return LibraryChoice(path=path, source="wheel",
                             reason=f"{WHEELS[major]} {v} matches torch's CUDA {torch_cuda}")
    if major is None and wheels:
        m = max(wheels)
        path, v = wheels[m]
        return LibraryChoice(path=path, source="wheel", reason=f"torch is a CPU build; {WHEELS[m]} {v} is installed")
    bundled = torch_nccl(torch_lib_dir)
    if bundled:
        return LibraryChoice(path=bundled, source="torch", reason=f"torch's own libnccl (no {WHEELS.get(major, 'NCCL')} wheel)")
    if wheels:
        m = max(wheels)
        path, v = wheels[m]
        return LibraryChoice(path=path, source="wheel",
                             reason=f"{WHEELS[m]} {v} does not match torch's CUDA {torch_cuda}, but it is the only NCCL found; "
                                    f"install {WHEELS.get(major, 'the matching wheel')} to match")
    extra = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    for d in (*extra, *system_dirs):
        p = os.path.join(d, SONAME)
        if os.path.isfile(p):
            return LibraryChoice(path=p, source="system", reason=f"no NCCL wheel or torch library; system library in {d}")
    return LibraryChoice(path=SONAME, source="system", exists=False,
                         reason="no NCCL wheel, torch library or system file found; asking the dynamic loader for " + SONAME)


def _site_dirs() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(p)]


def current_choice() -> LibraryChoice:
    """`choose_library` for this process."""
    try:
        import torch

        torch_cuda, torch_lib = torch.version.cuda, os.path.join(os.path.dirname(torch.__file__), "lib")
    except ImportError:
        torch_cuda, torch_lib = None, None
    return choose_library(env=os.environ, torch_cuda=torch_cuda, site_dirs=_site_dirs(), torch_lib_dir=torch_lib)


_loaded: dict[str, NcclLibrary] = {}


def load_library(choice: LibraryChoice | None = None) -> NcclLibrary:
    """Load (once per process and path) the library `current_choice()` picks, and log it."""
    choice = choice or current_choice()
    lib = _loaded.get(choice.path)
    if lib is None:
        try:
            lib = NcclLibrary(choice.path, choice.reason)
        except NcclUnavailable as e:
            raise NcclUnavailable(f"{e} (chosen because: {choice.reason}); install the gpu extra "
                                  f"(pip install 'reshard[gpu]') or set {ENV_LIBRARY}") from None
        _loaded[choice.path] = lib
        log.info("loaded NCCL %s from %s (%s)", lib.version, choice.path, choice.reason)
    return lib
