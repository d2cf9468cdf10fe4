"""The NCCL data plane on CPU: library discovery, versions, ncclConfig_t layouts, unique ids,
error mapping, backend selection, the transport's polling and abort logic (against a fake
library and fake streams), and `reshard doctor`. Nothing here needs a GPU or libnccl; the
few checks of a real libnccl skip when none is installed."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import logging
import time
import weakref

import pytest
import torch

from reshard.common.dataplane import nccl
from reshard.common.dataplane.backend import BackendError, buffers_device, select_backend
from reshard.common.dataplane.engine import StagingPool
from reshard.common.dataplane.nccl import (
    LibraryChoice,
    NcclError,
    NcclLibrary,
    NcclUnavailable,
    choose_library,
    config_struct,
    decode_version,
    make_config,
    ncclUniqueId,
    version_code,
    version_string,
)
from reshard.common.dataplane.nccl_transport import NcclTransport
from reshard.common.dataplane.transport import TransportError, transport_class

# -- versions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("code,version", [(22304, (2, 23, 4)), (21605, (2, 16, 5)), (23203, (2, 32, 3)),
                                          (2304, (2, 3, 4)), (2708, (2, 7, 8)), (30001, (3, 0, 1))])
def test_version_decoding(code, version):
    assert decode_version(code) == version
    assert version_code(*version) == code
    assert version_string(code) == ".".join(map(str, version))


def test_old_and_new_encodings_meet_at_2_9():
    assert version_code(2, 8, 4) == 2804 and version_code(2, 9, 6) == 20906
    with pytest.raises(ValueError):
        decode_version(-1)


# -- ncclConfig_t -------------------------------------------------------------------------------
# sizeof(ncclConfig_t) and field offsets, compiled with gcc (x86-64) from the nccl.h of each
# nvidia-nccl-cu12 wheel, and of nvidia-nccl-cu13 2.28.9 (same as cu12 2.28.9).
HEADER_LAYOUTS = {
    21605: (24, {"blocking": 16}),
    21701: (40, {"cgaClusterSize": 20, "maxCTAs": 28, "netName": 32}),
    21801: (48, {"splitShare": 40}),
    22105: (48, {"splitShare": 40}),
    22304: (48, {"netName": 32, "splitShare": 40}),
    22501: (48, {"splitShare": 40}),
    22602: (48, {"trafficClass": 44}),
    22707: (72, {"commName": 48, "collnetEnable": 56, "nvlsCTAs": 68}),
    22809: (80, {"nChannelsPerNetPeer": 72, "nvlinkCentricSched": 76}),
    22907: (88, {"graphUsageMode": 80, "numRmaCtx": 84}),
    23007: (96, {"maxP2pPeers": 88, "graphStreamOrdering": 92}),
    23102: (112, {"launchOrderImplicit": 96, "hostCftMode": 108}),
    23203: (120, {"nvlsHostMode": 112}),
}


@pytest.mark.parametrize("version", sorted(HEADER_LAYOUTS))
def test_config_layout_matches_each_header(version):
    size, offsets = HEADER_LAYOUTS[version]
    cls = config_struct(version)
    assert ctypes.sizeof(cls) == size
    assert (cls.size.offset, cls.magic.offset, cls.version.offset, cls.blocking.offset) == (0, 8, 12, 16)
    for name, off in offsets.items():
        assert getattr(cls, name).offset == off, name


def test_config_initializer_semantics():
    cfg = make_config(22304, blocking=0)
    assert cfg.size == ctypes.sizeof(cfg) == 48 and cfg.magic == 0xCAFEBEEF and cfg.version == 22304
    assert cfg.blocking == 0
    assert cfg.cgaClusterSize == cfg.minCTAs == cfg.maxCTAs == cfg.splitShare == -(2**31)  # NCCL_CONFIG_UNDEF_INT
    assert cfg.netName is None  # NCCL_CONFIG_UNDEF_PTR


def test_config_of_a_newer_library_describes_the_newest_known_header():
    cfg = make_config(23501, blocking=1)
    assert cfg.version == nccl.CONFIG_NEWEST_KNOWN and cfg.size == 120 and cfg.blocking == 1


def test_config_refuses_old_versions_and_unknown_fields():
    with pytest.raises(ValueError, match="2.14"):
        config_struct(21303)
    with pytest.raises(ValueError, match="trafficClass"):
        make_config(22304, trafficClass=1)


# -- unique ids and errors ------------------------------------------------------------------------


def test_unique_id_round_trip():
    data = bytes(range(128))
    uid = ncclUniqueId.from_bytes(data)
    assert ctypes.sizeof(uid) == 128 and uid.to_bytes() == data
    with pytest.raises(ValueError, match="128 bytes"):
        ncclUniqueId.from_bytes(b"\0" * 127)


def _fake_library(strings: dict[int, bytes]) -> NcclLibrary:
    lib = NcclLibrary.__new__(NcclLibrary)
    lib._fns = {"ncclGetErrorString": lambda code: strings.get(code, b"")}
    lib.path, lib.version_code, lib.version = "fake", 22304, "2.23.4"
    return lib


def test_error_mapping():
    lib = _fake_library({4: b"invalid argument (run with NCCL_DEBUG=WARN for details)"})
    with pytest.raises(NcclError) as e:
        lib.check(4, "ncclSend")
    assert e.value.code == 4 and e.value.code_name == "ncclInvalidArgument"
    assert str(e.value) == "ncclSend failed: ncclInvalidArgument (4): invalid argument (run with NCCL_DEBUG=WARN for details)"
    assert isinstance(e.value, TransportError)  # the worker reports it as a data-plane failure
    assert lib.check(0, "ncclSend") == 0
    assert lib.check(7, "ncclGroupEnd", in_progress_ok=True) == 7
    with pytest.raises(NcclError, match="ncclInProgress"):
        lib.check(7, "ncclGroupEnd")
    assert NcclError("ncclX", 42).code_name == "ncclResult 42"
    assert [nccl.RESULT_NAMES[c] for c in (1, 2, 3, 6, 8)] == [
        "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError", "ncclRemoteError", "ncclTimeout"]


def test_function_table_has_each_call_the_transport_uses():
    names = {f.name for f in nccl.FUNCTIONS}
    assert {"ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig", "ncclCommGetAsyncError", "ncclCommAbort",
            "ncclCommDestroy", "ncclCommFinalize", "ncclSend", "ncclRecv", "ncclGroupStart", "ncclGroupEnd",
            "ncclGetErrorString"} <= names
    send = next(f for f in nccl.FUNCTIONS if f.name == "ncclSend")
    assert send.argtypes == (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


# -- library discovery on fake trees --------------------------------------------------------------


def _wheel(site, major: int, version: str = "2.21.5", with_lib: bool = True):
    name = f"nvidia_nccl_cu{major}-{version}.dist-info"
    info = site / name
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu{major}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"nvidia/nccl/lib/libnccl.so.2,,\nnvidia/nccl/include/nccl.h,,\n{name}/RECORD,,\n")
    lib = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    if with_lib:
        lib.parent.mkdir(parents=True)
        lib.write_bytes(b"\x7fELF")
    return str(lib)


@pytest.fixture
def trees(tmp_path):
    cu12, cu13, torch_lib, sys_lib = (tmp_path / n for n in ("site12", "site13", "torchlib", "syslib"))
    for d in (cu12, cu13, torch_lib, sys_lib):
        d.mkdir()
    return {"cu12": cu12, "cu13": cu13, "torch": torch_lib, "sys": sys_lib, "root": tmp_path}


def test_env_override_wins(trees):
    _wheel(trees["cu12"], 12)
    mine = trees["root"] / "custom" / "libnccl.so.2"
    mine.parent.mkdir()
    mine.write_bytes(b"")
    c = choose_library(env={"RESHARD_NCCL_LIBRARY": str(mine)}, torch_cuda="12.8", site_dirs=[str(trees["cu12"])])
    assert (c.path, c.source) == (str(mine), "env") and "RESHARD_NCCL_LIBRARY" in c.reason
    with pytest.raises(NcclUnavailable, match="RESHARD_NCCL_LIBRARY=.*is not a file"):
        choose_library(env={"RESHARD_NCCL_LIBRARY": str(mine) + ".missing"}, torch_cuda="12.8", site_dirs=[])


@pytest.mark.parametrize("torch_cuda,major", [("12.8", 12), ("13.0", 13)])
def test_wheel_matching_torchs_cuda_major(trees, torch_cuda, major):
    libs = {12: _wheel(trees["cu12"], 12, "2.27.7"), 13: _wheel(trees["cu13"], 13, "2.28.9")}
    (trees["torch"] / "libnccl.so.2").write_bytes(b"")
    c = choose_library(env={}, torch_cuda=torch_cuda, site_dirs=[str(trees["cu12"]), str(trees["cu13"])],
                       torch_lib_dir=str(trees["torch"]))
    assert (c.path, c.source) == (libs[major], "wheel")
    assert f"nvidia-nccl-cu{major}" in c.reason and torch_cuda in c.reason


def test_torch_library_before_a_mismatched_wheel(trees):
    _wheel(trees["cu13"], 13)
    (trees["torch"] / "libnccl.so.2").write_bytes(b"")
    (trees["torch"] / "libtorch_cuda.so").write_bytes(b"")
    c = choose_library(env={}, torch_cuda="12.4", site_dirs=[str(trees["cu13"])], torch_lib_dir=str(trees["torch"]))
    assert (c.path, c.source) == (str(trees["torch"] / "libnccl.so.2"), "torch")


def test_mismatched_wheel_when_nothing_else(trees):
    lib = _wheel(trees["cu13"], 13)
    c = choose_library(env={}, torch_cuda="12.4", site_dirs=[str(trees["cu13"])], torch_lib_dir=str(trees["torch"]),
                       system_dirs=[str(trees["sys"])])
    assert (c.path, c.source) == (lib, "wheel") and "does not match" in c.reason


def test_cpu_torch_takes_an_installed_wheel(trees):
    lib = _wheel(trees["cu12"], 12)
    c = choose_library(env={}, torch_cuda=None, site_dirs=[str(trees["cu12"])])
    assert c.path == lib and "CPU build" in c.reason


def test_wheel_without_its_library_is_skipped_then_system(trees):
    _wheel(trees["cu12"], 12, with_lib=False)
    (trees["sys"] / "libnccl.so.2").write_bytes(b"")
    c = choose_library(env={}, torch_cuda="12.8", site_dirs=[str(trees["cu12"])], torch_lib_dir=None,
                       system_dirs=[str(trees["root"] / "nowhere"), str(trees["sys"])])
    assert (c.path, c.source, c.exists) == (str(trees["sys"] / "libnccl.so.2"), "system", True)


def test_ld_library_path_then_the_loader(trees):
    (trees["sys"] / "libnccl.so.2").write_bytes(b"")
    c = choose_library(env={"LD_LIBRARY_PATH": str(trees["sys"])}, torch_cuda="12.8", site_dirs=[], system_dirs=[])
    assert c.path == str(trees["sys"] / "libnccl.so.2")
    c = choose_library(env={}, torch_cuda="12.8", site_dirs=[], system_dirs=[str(trees["root"] / "nowhere")])
    assert (c.path, c.source, c.exists) == ("libnccl.so.2", "system", False)


def test_loading_something_that_is_not_nccl_fails_clearly(trees):
    bogus = trees["root"] / "libnccl.so.2"
    bogus.write_bytes(b"not an ELF file")
    with pytest.raises(NcclUnavailable, match="cannot load .*RESHARD_NCCL_LIBRARY"):
        nccl.load_library(LibraryChoice(path=str(bogus), source="env", reason="test"))


# -- a real libnccl, where one is installed (the gpu extra, or RESHARD_NCCL_LIBRARY) ---------------


@pytest.fixture(scope="module")
def real_lib():
    try:
        choice = nccl.current_choice()
        if not choice.exists:
            pytest.skip("no libnccl installed (pip install '.[gpu]' or set RESHARD_NCCL_LIBRARY)")
        return nccl.load_library(choice)
    except NcclUnavailable as e:
        pytest.skip(f"no usable libnccl: {e}")


def test_real_library_version_and_unique_ids(real_lib):
    assert real_lib.version == version_string(real_lib.version_code)
    assert decode_version(real_lib.version_code) >= (2, 14, 0)
    a, b = real_lib.unique_id(), real_lib.unique_id()
    assert len(a) == len(b) == 128 and a != b
    assert "invalid argument" in real_lib.error_string(4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_real_library_init_without_a_gpu_raises_a_typed_error(real_lib):
    with pytest.raises(NcclError) as e:
        real_lib.comm_init_rank(1, real_lib.unique_id(), 0)
    assert e.value.code not in (0, 7) and e.value.code_name.startswith("nccl")


# -- backend selection ------------------------------------------------------------------------------


def test_backend_auto():
    assert select_backend("auto", {0: "cpu", 1: "cpu"}, {0: "cpu"}) == "gloo"
    assert select_backend("auto", {0: "cuda:0", 1: "cuda:1"}, {0: "cuda:0", 1: "cuda:3"}) == "nccl"
    assert select_backend("auto", {0: ""}, {0: "cpu"}) == "gloo"  # a worker that does not report: cpu


def test_backend_forced():
    assert select_backend("nccl", {0: "cuda:0"}, {0: "cuda:1"}) == "nccl"
    assert select_backend("gloo", {0: "cpu"}, {0: "cpu"}) == "gloo"
    with pytest.raises(BackendError, match=r"--backend nccl needs CUDA buffers, but trainer ranks \[0, 1\] and inference ranks \[0\]"):
        select_backend("nccl", {0: "cpu", 1: "cpu"}, {0: "cpu"})
    with pytest.raises(BackendError, match="--backend gloo moves CPU buffers"):
        select_backend("gloo", {0: "cuda:0"}, {0: "cuda:0"})


def test_mixed_session_refused_naming_ranks():
    with pytest.raises(BackendError) as e:
        select_backend("auto", {0: "cuda:0", 1: "cpu"}, {0: "cuda:0", 1: "cuda:1", 2: "cpu", 3: "cpu"})
    msg = str(e.value)
    assert "mixed CPU/GPU session refused" in msg
    assert "trainer ranks [1] and inference ranks [2, 3] hold CPU buffers" in msg
    assert "trainer ranks [0] and inference ranks [0, 1] hold CUDA buffers" in msg
    for forced in ("gloo", "nccl"):
        with pytest.raises(BackendError, match="mixed"):
            select_backend(forced, {0: "cuda:0"}, {0: "cpu"})


def test_backend_ipc_when_every_worker_is_on_one_gpu():
    """Colocation is matched by GPU UUID, not by index (each process numbers its GPUs its own way)."""
    one = {"t": {0: "cuda:0", 1: "cuda:0"}, "i": {0: "cuda:1", 1: "cuda:0"}}
    same = ({0: "GPU-a", 1: "GPU-a"}, {0: "GPU-a", 1: "GPU-a"})
    assert select_backend("auto", one["t"], one["i"], *same) == "ipc"
    assert select_backend("ipc", one["t"], one["i"], *same) == "ipc"
    apart = ({0: "GPU-a", 1: "GPU-b"}, {0: "GPU-c", 1: "GPU-d"})
    assert select_backend("auto", one["t"], one["i"], *apart) == "nccl"
    assert select_backend("auto", one["t"], one["i"], same[0], {0: "GPU-a", 1: ""}) == "nccl"  # one does not say
    assert select_backend("auto", one["t"], one["i"]) == "nccl"  # older controllers: no UUIDs at all
    assert select_backend("auto", one["t"], one["i"], {0: "GPU-a", 1: "GPU-b"}, {0: "GPU-c", 1: "GPU-a"}) == "hybrid"
    with pytest.raises(BackendError, match="--backend ipc needs every trainer and inference worker's buffers on one GPU"):
        select_backend("ipc", one["t"], one["i"], *apart)
    with pytest.raises(BackendError, match="--backend ipc needs .* hold CPU buffers"):
        select_backend("ipc", {0: "cpu"}, {0: "cpu"})
    with pytest.raises(BackendError, match="NCCL cannot hold two ranks of one GPU"):
        select_backend("nccl", one["t"], one["i"], *same)


def test_backend_hybrid_when_some_workers_share_a_gpu():
    """The colocated setup on several GPUs (a trainer rank and inference ranks on each): NCCL between
    GPUs, CUDA IPC within one. Two trainer ranks on a GPU are refused by name; NCCL is refused where
    ranks share a GPU; hybrid is refused without CUDA or without every GPU's UUID."""
    dev = {0: "cuda:0", 1: "cuda:1"}
    pairs = ({0: "GPU-a", 1: "GPU-b"}, {0: "GPU-a", 1: "GPU-b"})
    assert select_backend("auto", dev, dev, *pairs) == "hybrid"
    assert select_backend("hybrid", dev, dev, *pairs) == "hybrid"
    assert select_backend("auto", dev, {0: "cuda:2"}, pairs[0], {0: "GPU-b"}) == "hybrid"  # partly colocated
    assert select_backend("hybrid", dev, dev, pairs[0], {0: "GPU-c", 1: "GPU-d"}) == "hybrid"  # nothing shared: NCCL alone
    assert select_backend("hybrid", {0: "cuda:0"}, {0: "cuda:0"}, {0: "GPU-a"}, {0: "GPU-a"}) == "hybrid"
    with pytest.raises(BackendError, match=r"--backend nccl cannot run here: some workers share a GPU.*--backend auto \(hybrid"):
        select_backend("nccl", dev, dev, *pairs)
    assert select_backend("auto", dev, dev, pairs[0], {0: "GPU-b", 1: "GPU-b"}) == "hybrid"  # two replicas on GPU b
    with pytest.raises(BackendError, match=r"trainer ranks \[0, 1\] share GPU GPU-a: .*at most one trainer rank per GPU"):
        select_backend("auto", dev, dev, {0: "GPU-a", 1: "GPU-a"}, pairs[1])
    with pytest.raises(BackendError, match=r"trainer ranks \[0, 1\] share GPU GPU-a"):
        select_backend("hybrid", dev, dev, {0: "GPU-a", 1: "GPU-a"}, {0: "GPU-a", 1: "GPU-a"})
    with pytest.raises(BackendError, match="--backend hybrid needs CUDA buffers"):
        select_backend("hybrid", {0: "cpu"}, {0: "cpu"})
    with pytest.raises(BackendError, match="--backend hybrid needs every worker's GPU UUID"):
        select_backend("hybrid", dev, dev, pairs[0], {0: "GPU-a", 1: ""})


def test_ipc_sessions_plan_without_relays():
    from reshard.common.dataplane.backend import plan_options

    assert plan_options(0, "ipc").relay is False and plan_options(4096, "ipc").bucket_bytes == 4096
    assert plan_options(0, "hybrid").relay is False
    assert plan_options(0, "nccl").relay is True and plan_options(0, "gloo") == plan_options(0, "nccl")


def test_ipc_session_waits_end_at_the_deadline_or_an_abort():
    """The session's steps go through the controller's rendezvous store; a rank whose peer never
    posts fails at the deadline, and at once when the update is aborted from another thread."""
    import threading

    from reshard.common.dataplane.cuda_ipc import IpcTransport
    from reshard.common.dataplane.transport import serve_store

    store, sock = serve_store("127.0.0.1", 10.0)
    port = sock.getsockname()[1]
    with pytest.raises(TransportError, match="uses CUDA IPC, but rank 0's buffers are on cpu"):
        IpcTransport("127.0.0.1", port, "s", 0, 2, 5.0, device="cpu", key="k")
    a = IpcTransport("127.0.0.1", port, "s", 0, 2, 5.0, device="cuda:0", key="k")  # no CUDA call until data moves
    b = IpcTransport("127.0.0.1", port, "s", 1, 2, 5.0, device="cuda:0", key="k")
    a.store.put("u/handles/0", b"h0")
    b.store.wait_keys(["u/handles/0"], time.monotonic() + 5, "never")
    assert b.store.get("u/handles/0") == b"h0"
    # Keys do not pile up in the controller's store: a slot's new key replaces its last, a taken key goes.
    a.store.put("u1/read/0", b"1", slot="read")
    a.store.put("u2/read/0", b"1", slot="read")
    with pytest.raises(TransportError, match="gone"):
        b.store.wait_keys(["u1/read/0"], time.monotonic() + 0.1, "gone")
    assert b.store.get("u2/read/0", take=True) == b"1"
    with pytest.raises(TransportError, match="taken"):
        b.store.wait_keys(["u2/read/0"], time.monotonic() + 0.1, "taken")
    other = IpcTransport("127.0.0.1", port, "s", 1, 2, 5.0, device="cuda:0", key="another")
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="destination ranks \\[1\\] did not finish"):
        other.store.wait_keys(["u/handles/0"], time.monotonic() + 0.3, "destination ranks [1] did not finish")  # other secret
    assert time.monotonic() - t0 < 2
    threading.Timer(0.2, a.abort, ("update u aborted",)).start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="update u aborted"):
        a.store.wait_keys(["u/read/1"], time.monotonic() + 30, "never")
    assert time.monotonic() - t0 < 2
    with pytest.raises(TransportError, match="moves no messages"):
        b.send(torch.zeros(1, dtype=torch.uint8), 0, 0)
    for t in (a, b, other):
        t.close()
    sock.close()


def test_ipc_source_checksums_match_what_lands():
    """A source rank's sums from its own buffers (what an IPC destination reads) add up, piece by
    piece, to the receivers' sums of what landed: computed apart, on the same bytes."""
    from reshard.common.dataplane.backend import plan_options
    from reshard.common.dataplane.checksum import P
    from reshard.common.dataplane.cuda_ipc import source_checksums
    from reshard.common.dataplane.engine import execute_in_memory, receiver_checksums
    from reshard.common.layout.core import dtype_of
    from reshard.common.models.frameworks import build
    from reshard.common.plan.planner import make_plan
    from reshard.tools.synth import init_box

    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=2")
    plan = make_plan(src, dst, plan_options(0, "ipc"))
    shapes = {n: t.shape for n, t in src.tensors.items()}

    def buffers(lay, rank, fill):
        out = {}
        for b in lay.ranks[rank]:
            out[b.name] = torch.zeros(b.shape, dtype=dtype_of(b.dtype))
            for p in b.pieces if fill else ():
                init_box(p.view(out[b.name]), 5, p.tensor, p.box.offset, shapes[p.tensor])
        return out

    sb = [buffers(src, r, True) for r in range(src.world)]
    db = [buffers(dst, r, False) for r in range(dst.world)]
    execute_in_memory(plan, sb, db)
    sent: dict = {}
    for r in range(src.world):
        for k, v in source_checksums(plan, r, sb[r], shapes).items():
            sent[k] = (sent.get(k, 0) + v) % P
    landed = {}
    for r in range(dst.world):
        landed.update(receiver_checksums(plan, r, db[r], dst, shapes))
    assert sent == landed and len(sent) > 10
    before = source_checksums(plan, 1, sb[1], shapes)
    name = next(b.name for b in src.ranks[1] if b.pieces)
    sb[1][name].view(-1)[3] += 1  # a changed source element changes its piece's sum
    after = source_checksums(plan, 1, sb[1], shapes)
    assert after.keys() == before.keys() and sum(after[k] != before[k] for k in after) == 2  # both DP replicas read it


def test_backend_bad_names_and_devices():
    with pytest.raises(BackendError, match="valid backends: auto, gloo, nccl, ipc"):
        select_backend("mpi", {}, {})
    with pytest.raises(BackendError, match="meta"):
        select_backend("auto", {0: "meta"}, {0: "cpu"})


def test_buffers_device():
    assert buffers_device([torch.zeros(2), torch.zeros(3)]) == "cpu"
    assert buffers_device([]) == "cpu"
    with pytest.raises(ValueError, match="one device"):
        buffers_device([torch.zeros(2), torch.empty(2, device="meta")])


def test_transport_registry_knows_nccl():
    from reshard.common.dataplane.hybrid import HybridTransport

    assert transport_class("nccl") is NcclTransport and transport_class("hybrid") is HybridTransport
    with pytest.raises(ValueError, match="valid transports: gloo, hybrid, ipc, nccl"):
        transport_class("mpi")


def test_nccl_transport_refuses_cpu_buffers_and_sessions_without_an_id():
    from reshard.proto import reshard_pb2 as pb

    with pytest.raises(TransportError, match="CUDA buffers; this worker's are on cpu"):
        NcclTransport(b"\0" * 128, 0, 2, 1.0, device="cpu")
    with pytest.raises(TransportError, match="no nccl_unique_id"):
        NcclTransport.for_session(pb.Session(id="s1", transport="nccl"), 0, 2, 1.0, device="cuda:0")


# -- the transport's logic against a fake library and fake streams ------------------------------------
# The fakes are strict (issue 28, item 29). What real NCCL refuses they refuse as it does: an NcclError
# with the code NCCL returns (a group ended that never started, a NULL communicator, a peer or root out
# of range, a call on a communicator whose last call is still ncclInProgress). What NCCL and CUDA take
# but the transport's contract forbids fails the test at once (FakeMisuse): work on any stream but the
# transport's comm stream, sends and receives outside a group, a communicator used after it was aborted,
# finalized or destroyed, a wait for (or poll of) an event never recorded, counts that differ between a
# send and its receive. Each stream has its own handle and each communicator its own: the fake before
# gave every stream handle 0 and took any call on any stream or communicator, so a send posted on the
# copy stream passed.


class FakeMisuse(AssertionError):
    """A call real NCCL or CUDA would take that breaks the transport's contract (it would hang, corrupt
    or order nothing on a GPU): fails the test."""


_STREAMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> FakeStream
_HANDLES = itertools.count(0x7F3A00001000, 0x200)  # like cudaStream_t and ncclComm_t pointers: distinct, never 0


class FakeEvent:
    """Records and host waits go to the FakeCuda's log, in order: ("record", stream, id), ("query", id)
    (the host's first poll of it). Polling or waiting for one never recorded fails: CUDA would report it
    complete at once, ordering nothing."""

    def __init__(self, cuda):
        self.cuda, self.polls, self.stream = cuda, 0, None
        self.id = cuda.events = cuda.events + 1

    def record(self, stream):
        if stream.cuda is not self.cuda:
            raise FakeMisuse(f"event {self.id} recorded on another device's {stream.name} stream")
        self.stream = stream
        self.cuda.log.append(("record", stream.name, self.id))

    def query(self):
        if self.stream is None:
            raise FakeMisuse(f"the host polls event {self.id}, never recorded (CUDA reports it complete at once)")
        self.polls += 1
        if self.polls == 1:
            self.cuda.log.append(("query", self.id))
        return self.cuda.complete_after is not None and self.polls > self.cuda.complete_after


class FakeStream:
    """A stream with a handle of its own (`cuda_stream`, what NCCL is given)."""

    def __init__(self, cuda=None, name="default"):
        self.cuda, self.name = cuda, name
        self.waits = self.syncs = 0
        self.cuda_stream = next(_HANDLES)
        _STREAMS[self.cuda_stream] = self

    def wait_event(self, ev):
        if ev.stream is None:
            raise FakeMisuse(f"the {self.name} stream waits for event {ev.id}, never recorded (CUDA orders nothing after it)")
        if ev.stream is self:
            raise FakeMisuse(f"the {self.name} stream waits for its own event {ev.id} (orders nothing)")
        self.waits += 1
        if self.cuda is not None:
            self.cuda.log.append(("wait", self.name, ev.id))

    def wait_stream(self, other):
        if other is self:
            raise FakeMisuse(f"the {self.name} stream waits for itself (orders nothing)")
        self.waits += 1
        if self.cuda is not None:
            self.cuda.log.append(("wait_stream", self.name, other.name))

    def synchronize(self):
        self.syncs += 1


class FakeCuda:
    def __init__(self):
        self.complete_after = 0  # events complete after this many polls (None: never)
        self.log: list[tuple] = []  # stream waits, event records and host polls, in order
        self.events = 0
        self.made = iter(("comm", "copy"))  # the transport makes its comm stream, then its copy stream
        self.current = FakeStream(self)

    def set_device(self):
        pass

    def stream(self):
        return FakeStream(self, next(self.made))

    def event(self):
        return FakeEvent(self)

    def current_stream(self):
        return self.current

    def use_stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def using():
            before, self.current = self.current, s
            try:
                yield
            finally:
                self.current = before

        return using()

    def free_bytes(self):
        return 1 << 30

    def reserved_bytes(self):
        return 0


class FakeComm:
    """A communicator of one FakeNccl: its own handle (`value`, as in an ncclComm_t box), its size (None
    for a split's: the fake sees one rank's color only) and state. `pending`: its last call returned
    ncclInProgress and no ncclCommGetAsyncError has seen it settle yet."""

    def __init__(self, lib, name, nranks, rank):
        self.lib, self.name, self.nranks, self.rank = lib, name, nranks, rank
        self.value = next(_HANDLES)
        self.state, self.pending = "ready", True  # ready | finalized | aborted | destroyed
        self.error = 0  # an error it met: every later call but ncclCommAbort returns it
        lib.comms[name] = self


@dataclasses.dataclass(frozen=True)
class Posted:
    """One send, receive or broadcast as the fake library took it."""

    call: str  # send | recv | broadcast
    peer: int  # the peer, or a broadcast's root
    nbytes: int
    comm: str  # the communicator's name: comm (the session's) or subN (a split's)
    stream: str  # the stream's name: comm, copy or default
    group: int | None  # which group (in launch order), None outside one


class FakeNccl:
    """Async-error answers come from a script: a list of codes, the last one repeating; a code 0 settles
    the polled communicator. With `wire` (a dict shared by every rank's FakeNccl) sends and receives move
    the bytes, in posting order per pair of ranks, as NCCL matches them: ranks then run one after
    another, senders first. `group_end`: what ncclGroupEnd returns, 0 or 7 (ncclInProgress: the group's
    communicators take no call until a poll settles them), or an error code, raised as NcclLibrary
    raises it (the communicators keep failing). `calls` may be the FakeCuda's log, to see both in one
    order; `posted` and `groups` say on which communicator and stream each operation was posted."""

    version = "2.23.4"

    def __init__(self, async_codes=(0,), group_end=0, calls=None, wire=None, missing=()):
        self.async_codes, self.group_end_code = list(async_codes), group_end
        self.calls: list[tuple] = [] if calls is None else calls
        self.wire, self.missing = wire, set(missing)
        self.aborted = self.destroyed = 0
        self.aborted_comms: list = []
        self.posted: list[Posted] = []
        self.groups: list[list[Posted]] = []  # each ended group's operations
        self.depth = 0  # ncclGroupStart nesting
        self.stream = None  # the comm stream: every operation goes to this one
        self.comms: dict[str, FakeComm] = {}  # by name

    def has(self, name):
        return name not in self.missing

    def error_string(self, code):
        return {4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
                5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
                6: "remote process exited or there was a network error"}.get(code, "")

    def last_error(self, comm=None):
        return ""

    def _fail(self, call, code, detail):
        raise NcclError(call, code, self.error_string(code), detail)

    def _comm(self, call, comm, settled=True) -> FakeComm:
        """The communicator a call names, checked as NCCL checks it, and as the transport must use it."""
        if comm is None or getattr(comm, "value", None) is None:
            self._fail(call, 4, "comm argument is NULL")
        if not isinstance(comm, FakeComm) or comm.lib is not self:
            raise FakeMisuse(f"{call} on a communicator this library did not make: {comm!r}")
        if comm.state in ("aborted", "destroyed"):
            raise FakeMisuse(f"{call} on communicator {comm.name} after it was {comm.state} (NCCL freed it)")
        if settled and comm.error:
            self._fail(call, comm.error, f"communicator {comm.name} failed before")
        if settled and comm.pending:
            self._fail(call, 4, "Attempt to use communicator before the previous operation returned ncclSuccess")
        if settled and comm.state == "finalized" and call != "ncclCommDestroy":
            raise FakeMisuse(f"{call} on communicator {comm.name} after ncclCommFinalize")
        return comm

    def _stream(self, call, handle) -> FakeStream:
        s = _STREAMS.get(handle)
        if s is None:
            self._fail(call, 1, f"cudaErrorInvalidResourceHandle: no stream {handle!r}")
        if s.name != "comm" or (self.stream is not None and s is not self.stream):
            raise FakeMisuse(f"{call} posted on the {s.name} stream (handle {handle:#x}); "
                             "the transport posts every NCCL operation on its comm stream")
        self.stream = s
        return s

    def _post(self, call, kind, ptr, n, peer, comm, stream) -> FakeComm:
        c = self._comm(call, comm)
        if kind != "broadcast" and self.depth == 0:
            raise FakeMisuse(f"{call} outside a group: the transport fuses a round's sends and receives in one "
                             "group (two ranks that each send first would deadlock)")
        if n < 0 or (n and not ptr):
            self._fail(call, 4, f"buffer {ptr!r} of {n} bytes")
        if c.nranks is not None and not 0 <= peer < c.nranks:
            self._fail(call, 4, f"{'root' if kind == 'broadcast' else 'peer'} {peer} out of range (nranks {c.nranks})")
        s = self._stream(call, stream)
        self.posted.append(Posted(kind, peer, n, c.name, s.name, len(self.groups) if self.depth else None))
        return c

    def comm_init_rank(self, world, uid, rank, blocking=False):
        if len(uid) != 128 or not 0 <= rank < world:
            self._fail("ncclCommInitRankConfig", 4, f"rank {rank} of {world}, a {len(uid)}-byte id")
        self.calls.append(("init", world, rank, blocking))
        self.rank = rank
        return FakeComm(self, "comm", world, rank)  # ncclInProgress until a poll settles it

    def comm_split(self, comm, color, key):
        import types

        parent = self._comm("ncclCommSplit", comm)
        parent.pending = True  # the split is in progress on the parent too
        self.calls.append(("split", color, key))
        if color < 0:
            return types.SimpleNamespace(value=None)  # NCCL_SPLIT_NOCOLOR: no communicator
        return FakeComm(self, f"sub{len(self.calls)}", None, None)

    def comm_async_error(self, comm):
        c = self._comm("ncclCommGetAsyncError", comm, settled=False)
        code = self.async_codes.pop(0) if len(self.async_codes) > 1 else self.async_codes[0]
        if c.error:
            return c.error
        if code == 0:
            c.pending = False
        elif code != 7:
            c.error = code
        return code

    def comm_abort(self, comm):
        c = self._comm("ncclCommAbort", comm, settled=False)  # the one call allowed at any time
        c.state = "aborted"
        self.aborted += 1
        self.aborted_comms.append(c.name)

    def comm_finalize(self, comm):
        c = self._comm("ncclCommFinalize", comm)
        self.calls.append(("finalize",) if c.name == "comm" else ("finalize", c.name))
        c.state, c.pending = "finalized", True
        return 7

    def comm_destroy(self, comm):
        self._comm("ncclCommDestroy", comm).state = "destroyed"
        self.destroyed += 1

    def group_start(self):
        self.calls.append(("group_start",))
        self.depth += 1
        if self.depth == 1:
            self._group_from = len(self.posted)

    def group_end(self):
        if self.depth == 0:
            self._fail("ncclGroupEnd", 5, "ncclGroupEnd: not in a group call")
        self.calls.append(("group_end",))
        self.depth -= 1
        if self.depth:
            return 0
        ops = self.posted[self._group_from:]
        self.groups.append(ops)
        code = self.group_end_code
        for name in {op.comm for op in ops}:
            if code == 7:  # ncclInProgress: every communicator in the group is
                self.comms[name].pending = True
            elif code:  # the group failed: so do its communicators, until aborted
                self.comms[name].error = code
        if code not in (0, 7):
            self._fail("ncclGroupEnd", code, "")  # as NcclLibrary.check does
        return code

    def send(self, ptr, n, peer, comm, stream):
        c = self._post("ncclSend", "send", ptr, n, peer, comm, stream)
        self.calls.append(("send", peer, n))
        if self.wire is not None:
            self.wire.setdefault((c.rank, peer), []).append(ctypes.string_at(ptr, n))
        return 0

    def recv(self, ptr, n, peer, comm, stream):
        c = self._post("ncclRecv", "recv", ptr, n, peer, comm, stream)
        self.calls.append(("recv", peer, n))
        if self.wire is not None:
            sent = self.wire.get((peer, c.rank))
            if not sent:
                raise FakeMisuse(f"rank {c.rank} receives {n} bytes from rank {peer}, which sent nothing "
                                 "(NCCL would wait for ever)")
            data = sent.pop(0)
            if len(data) != n:
                raise FakeMisuse(f"rank {peer} sent {len(data)} bytes into a {n}-byte receive "
                                 "(NCCL needs the same count and datatype on both ends)")
            ctypes.memmove(ptr, data, n)
        return 0

    def broadcast(self, sptr, rptr, n, root, comm, stream):
        c = self._post("ncclBroadcast", "broadcast", sptr, n, root, comm, stream)
        if sptr != rptr:
            raise FakeMisuse("the transport broadcasts in place")
        self.calls.append(("broadcast", root, n) if c.name == "comm" else ("broadcast", root, n, c.name))
        if self.depth == 0:
            self.groups.append([self.posted[-1]])
        return 0


def _transport(lib, cuda=None, rank=0, world=4, timeout=5.0):
    return NcclTransport(b"\0" * 128, rank, world, timeout, device="cpu", session="s", library=lib, cuda=cuda or FakeCuda())


def test_init_is_non_blocking_and_settles():
    lib = FakeNccl(async_codes=[7, 7, 7, 0])
    t = _transport(lib)
    assert lib.calls[0] == ("init", 4, 0, False)
    assert lib.async_codes == [0] and lib.aborted == 0 and t.init_seconds >= 0


def test_a_peer_that_never_joins_is_aborted_at_the_deadline():
    lib = FakeNccl(async_codes=[7])
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="joining NCCL session s as rank 0 of 4: not done within 0.2s .*aborted"):
        _transport(lib, timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.5
    assert lib.aborted == 1


def test_an_async_error_aborts_with_its_name():
    lib = FakeNccl(async_codes=[7, 6])
    with pytest.raises(NcclError, match="ncclRemoteError .*remote process exited.*communicator aborted"):
        _transport(lib)
    assert lib.aborted == 1


def test_a_round_is_one_group_in_matching_order():
    lib, cuda = FakeNccl(), FakeCuda()
    t = _transport(lib, cuda)
    buf = lambda n: torch.zeros(n, dtype=torch.uint8)  # noqa: E731
    works = [t.send(buf(10), 3, 5), t.recv(buf(11), 1, 2), t.send(buf(12), 1, 9), t.recv(buf(13), 1, 1)]
    assert not any(c[0] in ("send", "recv") for c in lib.calls)  # held until the round is flushed
    t.flush()
    ops = lib.calls[lib.calls.index(("group_start",)):]
    assert ops == [("group_start",), ("recv", 1, 13), ("recv", 1, 11), ("send", 1, 12), ("send", 3, 10), ("group_end",)]
    assert {(p.comm, p.stream, p.group) for p in lib.posted} == {("comm", "comm", 0)}  # one group, on the comm stream
    assert (t.comm_stream.name, t.copy_stream.name) == ("comm", "copy")
    assert t.comm_stream.waits == 1  # the comm stream waits for the copies
    for w in works:
        w.wait(1.0)
    with t.copy_context():
        assert t.copy_stream.waits == 1  # the copies wait for what the caller's stream queued
    # and have landed when the engine returns: an event after them, polled (never a synchronize)
    assert cuda.log[-2:] == [("record", "copy", cuda.events), ("query", cuda.events)] and t.copy_stream.syncs == 0


def test_wait_flushes_what_was_posted():
    lib = FakeNccl()
    t = _transport(lib)
    t.send(torch.zeros(4, dtype=torch.uint8), 2, 0).wait(1.0)
    assert ("send", 2, 4) in lib.calls and ("group_end",) in lib.calls


def test_a_frozen_peer_fails_the_wait_and_the_session():
    lib, cuda = FakeNccl(), FakeCuda()
    t = _transport(lib, cuda)
    cuda.complete_after = None  # the receive never completes
    w = t.recv(torch.zeros(8, dtype=torch.uint8), 1, 0)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="receive from rank 1 .* not done within 0.2s"):
        w.wait(0.2)
    assert time.monotonic() - t0 < 1.5 and lib.aborted == 1 and t.abort_seconds is not None
    with pytest.raises(TransportError, match="unusable"):
        t.send(torch.zeros(1, dtype=torch.uint8), 1, 0)


def test_group_in_progress_settles_before_its_event():
    lib, cuda = FakeNccl(group_end=7), FakeCuda()
    t = _transport(lib, cuda)
    w = t.send(torch.zeros(4, dtype=torch.uint8), 1, 0)
    t.flush()
    lib.async_codes = [7, 7, 0]  # connections to the new peer being set up
    w.wait(1.0)
    assert lib.async_codes == [0]


def test_posts_are_checked():
    t = _transport(FakeNccl())
    with pytest.raises(TransportError, match="contiguous uint8"):
        t.send(torch.zeros(4, dtype=torch.float32), 1, 0)
    with pytest.raises(TransportError, match="outside a session of 4"):
        t.recv(torch.zeros(4, dtype=torch.uint8), 4, 0)


def test_broadcast_whole_world_and_subset_without_split(caplog):
    lib = FakeNccl(missing={"ncclCommSplit"})
    t = _transport(lib, rank=0, world=3)
    t.broadcast(torch.zeros(6, dtype=torch.uint8), (0, 1, 2)).wait(1.0)
    assert ("broadcast", 0, 6) in lib.calls
    with caplog.at_level(logging.WARNING, logger="reshard.nccl"):
        for _ in range(2):
            t.prepare_broadcast([(0, 2), (0, 1)], 1.0)
    assert caplog.text.count("no ncclCommSplit") == 1 and not any(c[0] == "split" for c in lib.calls)
    t.broadcast(torch.zeros(6, dtype=torch.uint8), (0, 2)).wait(1.0)
    assert ("send", 2, 6) in lib.calls  # the star: the root sends to each member
    t2 = _transport(FakeNccl(missing={"ncclCommSplit"}), rank=2, world=3)
    t2.broadcast(torch.zeros(6, dtype=torch.uint8), (0, 2)).wait(1.0)
    assert ("recv", 0, 6) in t2.lib.calls


def test_close_finalizes_or_aborts(monkeypatch):
    lib = FakeNccl()
    t = _transport(lib)
    t.close()
    assert ("finalize",) in lib.calls and lib.destroyed == 1 and lib.aborted == 0
    monkeypatch.setattr("reshard.common.dataplane.nccl_transport.CLOSE_TIMEOUT_S", 0.1)
    lib = FakeNccl()
    t = _transport(lib)
    lib.async_codes = [7]  # a peer that never finalizes
    t.close()
    assert lib.destroyed == 0 and lib.aborted == 1


# -- staging pool, worker device and memory -----------------------------------------------------------


def test_staging_pool_is_reused_and_warns_past_its_limit(caplog):
    pool = StagingPool(limit_bytes=1024)
    assert pool.device == torch.device("cpu") and pool.nbytes == 0
    a = pool.get(512)
    assert pool.get(256).data_ptr() == a.data_ptr() and pool.allocations == 1
    with caplog.at_level(logging.WARNING, logger="reshard.engine"):
        pool.get(1024)
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="reshard.engine"):
        pool.get(4096)
    assert pool.nbytes == 4096 and "over the" in caplog.text and "bucket" in caplog.text


def test_worker_reports_device_and_memory():
    from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec
    from reshard.trainer_svc.worker import TrainerWorker

    spec = TensorSpec("w", (4, 8), "float32")
    desc = LocalBuffer("w", (4, 8), "float32", (Piece("w", Box((0, 0), (4, 8)), Box((0, 0), (4, 8))),))
    w = TrainerWorker("127.0.0.1:1", 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4, 8))}, snapshot=True)
    try:
        assert w.device == "cpu"
        assert w.memory_report() == {"staging": 0, "snapshot": 4 * 8 * 4}
    finally:
        w.stop()


# -- reshard doctor ---------------------------------------------------------------------------------


def test_doctor_json_on_cpu(tmp_path, monkeypatch, capsys):
    from reshard.cli import main

    monkeypatch.setenv("RESHARD_NCCL_LIBRARY", str(tmp_path / "missing" / "libnccl.so.2"))
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("torch_version", "torch_cuda", "cuda_available", "cuda_devices", "nccl_library", "nccl_version",
                "gloo_available", "nccl_error"):
        assert key in info, key
    assert info["torch_version"] == torch.__version__ and info["gloo_available"] is True
    assert info["torch_cuda"] == torch.version.cuda and info["cuda_available"] == torch.cuda.is_available()
    assert info["nccl_version"] is None and "RESHARD_NCCL_LIBRARY" in info["nccl_error"]


def test_doctor_text():
    from reshard import doctor

    info = doctor.collect()
    text = doctor.render(info)
    assert f"torch {torch.__version__}" in text and "gloo: available" in text
    assert ("NCCL " + info["nccl_version"] if info["nccl_version"] else "NCCL: none usable") in text


# -- the engine drives a transport round by round ------------------------------------------------------


def test_engine_flushes_once_per_round_inside_the_copy_context():
    import contextlib

    from reshard.common.dataplane.engine import Engine
    from reshard.common.layout.core import Box, Layout, LocalBuffer, Piece, TensorSpec
    from reshard.common.plan.planner import PlanOptions, make_plan
    from tests.unit.loopback import Loopback

    class Recording(Loopback):
        def __init__(self, rank, wire):
            super().__init__(rank, wire)
            self.flushes, self.inside = 0, False

        def flush(self):
            assert self.inside, "flushed outside the copy context"
            self.flushes += 1

        @contextlib.contextmanager
        def copy_context(self):
            self.inside = True
            yield
            self.inside = False

    rows, cols = 64, 96
    specs = {"w": TensorSpec("w", (rows, cols), "float32")}
    src = Layout(specs, ((LocalBuffer("w", (rows, cols), "float32", (Piece("w", Box.full((rows, cols)), Box.full((rows, cols))),)),),))
    half = cols // 2  # two destination ranks holding column halves: strided, so staged
    dst = Layout(specs, tuple((LocalBuffer("w", (rows, half), "float32", (Piece("w", Box.full((rows, half)), Box((0, r * half), (rows, half))),)),)
                              for r in range(2)))
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=4096, max_message_bytes=4096))
    full = torch.randn(rows, cols)
    wire: dict = {}
    deadline = time.monotonic() + 30
    sender = Recording(0, wire)
    Engine(sender, plan, "src", 0, {"w": full.clone()}, {"w": (rows, cols)}, StagingPool(), deadline).run()
    assert sender.flushes == len({m.round for m in plan.sends[0]}) > 1 and not sender.inside
    for r in range(2):
        out = torch.full((rows, half), float("nan"))
        receiver = Recording(1 + r, wire)
        Engine(receiver, plan, "dst", r, {"w": out}, {"w": (rows, cols)}, StagingPool(), deadline).run()
        assert receiver.flushes == len({m.round for m in plan.recvs[r]})
        assert torch.equal(out, full[:, r * half:(r + 1) * half])


# -- CUDA IPC handles (the mapping itself is GPU-checked only) -----------------------------------------


def test_ipc_handle_proto_round_trip_and_cpu_refusal():
    from reshard.common.dataplane.cuda_ipc import IpcHandle, export_tensor
    from reshard.proto import worker_pb2 as wpb

    h = IpcHandle(name="w", device=1, handle=b"\1" * 64, storage_bytes=4096, storage_offset=512, ref_counter_handle=b"ref",
                  ref_counter_offset=3, event_handle=b"\2" * 64, event_sync_required=True, dtype="bfloat16", shape=(2, 5),
                  stride=(5, 1), offset=7)
    wire = wpb.CudaIpcHandles(handles=[h.to_proto()]).SerializeToString()
    assert IpcHandle.from_proto(wpb.CudaIpcHandles.FromString(wire).handles[0]) == h
    with pytest.raises(ValueError, match="CUDA IPC exports CUDA tensors; w is on cpu"):
        export_tensor(torch.zeros(3), "w")


def test_trainer_cli_takes_a_backend():
    from reshard.cli import build_parser

    base = ["trainer", "--listen", "127.0.0.1:0"]
    assert build_parser().parse_args(base).backend == "auto"
    assert build_parser().parse_args(base + ["--backend", "nccl"]).backend == "nccl"
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--backend", "mpi"])


def test_worker_makes_session_ids_or_says_why_not(tmp_path, monkeypatch):
    import asyncio

    from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec
    from reshard.proto import worker_pb2 as wpb
    from reshard.trainer_svc.worker import TrainerWorker

    desc = LocalBuffer("w", (2, 2), "float32", (Piece("w", Box.full((2, 2)), Box.full((2, 2))),))
    w = TrainerWorker("127.0.0.1:1", 0, 1, {"w": TensorSpec("w", (2, 2), "float32")}, {"w": (desc, torch.zeros(2, 2))})
    try:
        monkeypatch.setenv("RESHARD_NCCL_LIBRARY", str(tmp_path / "missing.so"))
        with pytest.raises(TransportError, match="trainer rank 0 cannot make an NCCL session id: RESHARD_NCCL_LIBRARY="):
            asyncio.run(w._on_nccl_unique_id(wpb.NcclUniqueId(session="s"), 1))
        monkeypatch.delenv("RESHARD_NCCL_LIBRARY")
        try:
            nccl.load_library()
        except NcclUnavailable:
            return  # no libnccl here: the failing half is the one CI can check
        reply = asyncio.run(w._on_nccl_unique_id(wpb.NcclUniqueId(session="s"), 1))
        assert len(wpb.Reply(**reply).nccl_unique_id) == 128
    finally:
        w.stop()


def test_worker_device_choice_and_errors(monkeypatch):
    import torch

    from reshard.common.dataplane.backend import worker_device

    assert worker_device("cpu", 3) == torch.device("cpu") and worker_device("", 0) == torch.device("cpu")
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        worker_device("gpu", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        worker_device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert worker_device("cuda", 6) == torch.device("cuda", 2)  # one process per GPU, wrapping
    assert worker_device("cuda:1", 6) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="has 4 CUDA device"):
        worker_device("cuda:7", 0)


def test_cli_device_checked_before_starting(capsys):
    from reshard.cli import main

    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["inference", "--listen", "127.0.0.1:0", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trainer", "--listen", "127.0.0.1:0", "--device", "gpu"])


# -- stream-ordered rounds, warm-up and broadcast groups, against the fakes ---------------------------


def _relay_scene():
    """One trainer rank, three inference ranks: 'w' in column halves (ranks 0 and 2 hold the same
    half), 'v' whole on every rank, so inference ranks relay to their replicas; small buckets: many rounds."""
    from reshard.common.layout.core import Box, Layout, LocalBuffer, Piece, TensorSpec
    from reshard.common.plan.planner import PlanOptions, make_plan

    rows, cols, half = 64, 96, 48
    specs = {"w": TensorSpec("w", (rows, cols), "float32"), "v": TensorSpec("v", (rows, cols), "bfloat16")}

    def whole(n, dtype):
        return LocalBuffer(n, (rows, cols), dtype, (Piece(n, Box.full((rows, cols)), Box.full((rows, cols))),))

    src = Layout(specs, ((whole("w", "float32"), whole("v", "bfloat16")),))
    dst = Layout(specs, tuple((LocalBuffer("w", (rows, half), "float32", (Piece("w", Box.full((rows, half)), Box((0, (r % 2) * half), (rows, half))),)),
                               whole("v", "bfloat16")) for r in range(3)))
    plan = make_plan(src, dst, PlanOptions(bucket_bytes=4096, max_message_bytes=4096))
    full = {"w": torch.randn(rows, cols), "v": torch.randn(rows, cols).to(torch.bfloat16)}
    return plan, dst, full, {"w": (rows, cols), "v": (rows, cols)}


def _logged_copies(monkeypatch, log):
    from reshard.common.dataplane import engine

    for name in ("pack", "unpack"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda m, bufs, buf, real=real, name=name: (log.append((name, m.round)), real(m, bufs, buf)))


def _round_events(log):
    """The event recorded on the comm stream right after each group, in launch order."""
    out, after_group = [], False
    for e in log:
        if e == ("group_end",):
            after_group = True
        elif after_group and e[:2] == ("record", "comm"):
            out.append(e[2])
            after_group = False
    return out


def test_stream_ordered_engine_queues_rounds_and_waits_on_the_device(monkeypatch):
    from reshard.common.dataplane.engine import Engine, receiver_checksums
    from tests.unit.loopback import Loopback

    plan, dst, full, shapes = _relay_scene()
    assert any(m.relay for m in plan.messages) and len({m.round for m in plan.sends[0]}) > 4
    wire, deadline = {}, time.monotonic() + 30
    cuda = FakeCuda()
    _logged_copies(monkeypatch, cuda.log)
    t = _transport(FakeNccl(calls=cuda.log, wire=wire), cuda, rank=0, world=4)
    progress = []
    sums = Engine(t, plan, "src", 0, {k: v.clone() for k, v in full.items()}, shapes, StagingPool(), deadline,
                  progress=lambda d, n: progress.append(d)).run()
    log, events = cuda.log, _round_events(cuda.log)
    rounds = sorted({m.round for m in plan.sends[0]})
    assert {(p.comm, p.stream) for p in t.lib.posted} == {("comm", "comm")} and len(t.lib.groups) == len(rounds)
    assert len(events) == len(rounds) and progress[-1] == plan.send_bytes(0) and len(progress) == len(rounds)
    groups = [i for i, e in enumerate(log) if e == ("group_end",)]
    for k, ev in enumerate(events[:-1]):  # round k+1 is on the stream before the host first looks at round k
        assert groups[k + 1] < log.index(("query", ev))
    for k, ev in enumerate(events[:-2]):  # round k+2 packs into round k's half after the copy stream waits for round k
        assert groups[k] < log.index(("wait", "copy", ev)) < log.index(("pack", rounds[k + 2]))
    assert log[-2][:2] == ("record", "copy") and log[-1] == ("query", log[-2][2])  # the copies landed, by the deadline

    # The same plan over the loopback (host waits, host checksums): the same sender sums.
    assert sums == Engine(Loopback(0, {}), plan, "src", 0, full, shapes, StagingPool(), deadline).run()
    sent, relays = plan.expected_checksums(dict(sums)), 0
    for d in range(3):  # replicas after their relays' sources
        cuda = FakeCuda()
        _logged_copies(monkeypatch, cuda.log)
        t = _transport(FakeNccl(calls=cuda.log, wire=wire), cuda, rank=1 + d, world=4)
        out = {"w": torch.full((64, 48), float("nan")), "v": torch.zeros(64, 96, dtype=torch.bfloat16)}
        landed = Engine(t, plan, "dst", d, out, shapes, StagingPool(), deadline, receiver_sums=True).run()
        assert torch.equal(out["w"], full["w"][:, (d % 2) * 48 : (d % 2) * 48 + 48]) and torch.equal(out["v"], full["v"])
        got = receiver_checksums(plan, d, out, dst, shapes)
        assert got == {k: v for k, v in sent.items() if k[0] == d} and {k: got[k] for k in landed} == landed
        events = _round_events(cuda.log)
        mine = sorted({m.round for m in plan.recvs.get(d, []) + plan.relay_sends.get(d, [])})
        for i, r in enumerate(mine):
            if ("unpack", r) in cuda.log:  # a round's receives are unpacked after the copy stream waits for it
                assert cuda.log.index(("wait", "copy", events[i])) < cuda.log.index(("unpack", r))
            if any(m.round == r for m in plan.relay_sends.get(d, [])):
                # a relay is packed after the copy stream waited for the round before it (what it forwards landed)
                relays += 1
                assert cuda.log.index(("wait", "copy", events[i - 1])) < cuda.log.index(("pack", r))
    assert relays > 0
    assert not any(wire.values()), "messages sent but never received"


def test_stream_ordered_sender_sums_are_off_the_next_rounds_path(monkeypatch):
    """On a stream-ordered transport a round's sender checksums are queued on the copy stream after the
    next round's group is launched (which waits for what the copy stream queued before it: only its
    packing) and before the round after it packs into their half of the staging (issue 28, item 28).
    They were queued before the next round was posted, which then waited for them."""
    from reshard.common.dataplane.engine import Engine
    from tests.unit.loopback import Loopback

    plan, _, full, shapes = _relay_scene()
    rounds = sorted({m.round for m in plan.sends[0]})
    round_of = {id(seg): m.round for m in plan.sends[0] for seg in m.segments}
    cuda = FakeCuda()
    _logged_copies(monkeypatch, cuda.log)
    real = Engine._sender_checksum
    monkeypatch.setattr(Engine, "_sender_checksum", lambda self, dst, seg, wire, *a: (
        cuda.log.append(("sum", round_of[id(seg)])), real(self, dst, seg, wire, *a)))
    t = _transport(FakeNccl(calls=cuda.log, wire={}), cuda, rank=0, world=4)
    sums = Engine(t, plan, "src", 0, {k: v.clone() for k, v in full.items()}, shapes, StagingPool(),
                  time.monotonic() + 30).run()
    log = cuda.log
    groups = [i for i, e in enumerate(log) if e == ("group_end",)]
    assert len(groups) == len(rounds)
    for k, r in enumerate(rounds):
        at = [i for i, e in enumerate(log) if e == ("sum", r)]
        assert at, f"round {r} has no sender sums"
        if k + 1 < len(rounds):
            assert groups[k + 1] < min(at), f"round {r}'s sums were queued before round {rounds[k + 1]} was launched"
        if k + 2 < len(rounds):
            assert max(at) < log.index(("pack", rounds[k + 2])), f"round {rounds[k + 2]} packed over round {r}'s staging first"
    assert sums == Engine(Loopback(0, {}), plan, "src", 0, full, shapes, StagingPool(), time.monotonic() + 30).run()


def test_stream_ordered_final_wait_honours_deadline_and_abort():
    import threading

    from reshard.common.dataplane.engine import Engine

    plan, _, full, shapes = _relay_scene()
    cuda = FakeCuda()
    cuda.complete_after = None  # a peer that never posts: no group ever completes
    lib = FakeNccl()
    t = _transport(lib, cuda, rank=0, world=4)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="not done within"):
        Engine(t, plan, "src", 0, full, shapes, StagingPool(), time.monotonic() + 0.3).run()
    assert time.monotonic() - t0 < 1.5 and lib.aborted == 1

    cuda = FakeCuda()
    cuda.complete_after = None
    lib = FakeNccl()
    t = _transport(lib, cuda, rank=0, world=4)
    threading.Timer(0.2, t.abort, args=("update u1 aborted by the controller",)).start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="update u1 aborted by the controller"):
        Engine(t, plan, "src", 0, full, shapes, StagingPool(), time.monotonic() + 30).run()
    assert time.monotonic() - t0 < 1.5 and lib.aborted == 1


def test_leaving_the_engine_with_work_in_flight_aborts_the_session():
    from reshard.common.dataplane.engine import Engine

    plan, _, full, shapes = _relay_scene()
    cuda = FakeCuda()
    lib = FakeNccl()
    t = _transport(lib, cuda, rank=0, world=4)

    def hook(i):
        raise RuntimeError("the host's own failure")

    cuda.complete_after = 0  # round 0 completes, then the hook fails with later rounds still queued
    engine = Engine(t, plan, "src", 0, full, shapes, StagingPool(), time.monotonic() + 30, hook=hook)
    with pytest.raises(RuntimeError, match="own failure"):
        engine.run()
    assert lib.aborted == 1 and "work in flight" in t._broken


def test_warm_up_connects_each_pair_once_and_settles():
    cuda = FakeCuda()
    lib = FakeNccl(group_end=7, calls=cuda.log)  # ncclInProgress: connections being set up
    t = _transport(lib, cuda, rank=0, world=4)
    lib.async_codes = [7, 7, 0]
    t.warm_up({1, 3}, {1, 2}, 1.0)
    start = lib.calls.index(("group_start",))
    assert [c for c in lib.calls[start:] if c[0] in ("group_start", "send", "recv", "group_end")] == [
        ("group_start",), ("recv", 1, 1), ("send", 1, 1), ("recv", 2, 1), ("send", 3, 1), ("group_end",)]
    assert lib.async_codes == [0] and lib.aborted == 0
    n = len(lib.calls)
    t.warm_up({1, 3}, {1, 2}, 1.0)  # connected already: nothing posted
    t.warm_up(set(), set(), 1.0)
    assert len(lib.calls) == n
    t.warm_up({2}, {1}, 1.0)  # only the new pair
    assert [c for c in lib.calls[n:] if c[0] in ("send", "recv")] == [("send", 2, 1)]


def test_warm_up_with_a_peer_that_never_posts_fails_at_the_deadline():
    cuda = FakeCuda()
    lib = FakeNccl()
    t = _transport(lib, cuda, rank=0, world=4)
    cuda.complete_after = None
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=r"warm-up \(connecting to ranks \[1, 2\]\) .*not done within 0.2s"):
        t.warm_up({1}, {2}, 0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.5 and lib.aborted == 1
    lib = FakeNccl(group_end=7)
    t = _transport(lib, rank=0, world=4)
    lib.async_codes = [7]  # connection setup that never ends
    with pytest.raises(TransportError, match="warm-up .*not done within 0.2s"):
        t.warm_up({1}, set(), 0.2)
    assert lib.aborted == 1


def test_gloo_and_loopback_warm_up_and_prepare_nothing():
    from reshard.common.dataplane.transport import GlooTransport
    from tests.unit.loopback import Loopback

    assert not GlooTransport.stream_ordered and not Loopback.stream_ordered and NcclTransport.stream_ordered
    t = Loopback(0, {})
    assert t.warm_up({1}, {2}, 1.0) is None and t.prepare_broadcast([(0, 1)], 1.0) is None


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_prepare_broadcast_splits_on_every_rank(rank):
    lib = FakeNccl(calls=None)
    t = _transport(lib, rank=rank, world=4)
    groups = [(2, 0, 3), (0, 1, 2, 3), (1,)]  # root 2 first; the whole session; a group of one
    t.prepare_broadcast(groups, 1.0)
    member = rank in (0, 2, 3)
    splits = [c for c in lib.calls if c[0] == "split"]
    assert splits == [("split", 0 if member else -1, rank)]  # only the subset needs a communicator
    if member:
        sub = f"sub{lib.calls.index(splits[0]) + 1}"
        assert ("broadcast", 1, 1, sub) in lib.calls  # connected at once; root 2 is rank 1 of (0, 2, 3)
        t.broadcast(torch.zeros(6, dtype=torch.uint8), (2, 0, 3)).wait(1.0)
        assert lib.calls[-1] == ("broadcast", 1, 6, sub)
        assert lib.posted[-1] == Posted("broadcast", 1, 6, sub, "comm", None)  # the split's communicator, the comm stream
        assert lib.comms[sub].value != lib.comms["comm"].value
        assert not any(c[0] in ("send", "recv") for c in lib.calls)
    t.prepare_broadcast(groups, 1.0)  # made once
    assert [c for c in lib.calls if c[0] == "split"] == splits
    t.close()
    assert lib.destroyed == (2 if member else 1) and lib.aborted == 0
    if member:
        assert lib.calls.index(("finalize", sub)) < lib.calls.index(("finalize",))


def test_broadcast_groups_are_aborted_with_the_session_and_needed_before_use():
    lib = FakeNccl()
    t = _transport(lib, rank=0, world=4)
    with pytest.raises(TransportError, match="prepare_broadcast"):
        t.broadcast(torch.zeros(6, dtype=torch.uint8), (0, 1))
    t.prepare_broadcast([(0, 1), (0, 2, 3)], 1.0)
    t.abort("update u2 aborted")
    assert lib.aborted == 3 and lib.aborted_comms[-1] == "comm"
    with pytest.raises(TransportError, match="u2 aborted"):
        t.broadcast(torch.zeros(6, dtype=torch.uint8), (0, 1))


def test_a_split_whose_communicator_never_comes_fails_at_the_deadline():
    import types

    lib = FakeNccl()
    lib.comm_split = lambda comm, color, key: types.SimpleNamespace(value=None)
    t = _transport(lib, rank=0, world=4)
    with pytest.raises(TransportError, match=r"splitting a communicator for ranks \[0, 1\] .*no communicator within 0.2s"):
        t.prepare_broadcast([(0, 1)], 0.2)
    assert lib.aborted == 1


def test_serialized_baseline_prepares_its_broadcast_group_on_every_rank():
    """Every rank, trainer ranks outside the broadcast included, asks for the group first."""
    from types import SimpleNamespace

    from reshard.common.layout.core import Box, Layout, LocalBuffer, Piece, TensorSpec
    from reshard.tools import baseline
    from tests.unit.loopback import Done, Loopback

    class Recording(Loopback):
        def prepare_broadcast(self, groups, timeout_s):
            calls.append((self.rank, groups))

        def broadcast(self, buf, members):
            if self.rank == members[0]:
                self.wire["bcast"] = buf.clone()
            else:
                buf.copy_(self.wire["bcast"])
            return Done()

    calls: list = []
    specs = {"w": TensorSpec("w", (4, 8), "float32")}
    src = Layout(specs, tuple((LocalBuffer("w", (2, 8), "float32", (Piece("w", Box.full((2, 8)), Box((2 * r, 0), (2, 8))),)),) for r in range(2)))
    dst = Layout(specs, tuple((LocalBuffer("w", (4, 8), "float32", (Piece("w", Box.full((4, 8)), Box.full((4, 8))),)),) for _ in range(2)))
    full, wire, session = torch.randn(4, 8), {}, SimpleNamespace(src_world=2, dst_world=2)
    deadline = time.monotonic() + 30
    for side, rank, bufs in [("src", 1, {"w": full[2:].clone()}), ("src", 0, {"w": full[:2].clone()}),
                             ("dst", 0, {"w": torch.zeros(4, 8)}), ("dst", 1, {"w": torch.zeros(4, 8)})]:
        baseline.run(side, Recording(rank if side == "src" else 2 + rank, wire), session, rank, src, dst, bufs,
                     {"w": (4, 8)}, StagingPool(), deadline, lambda a, b: None, timeout=30)
        if side == "dst":
            assert torch.equal(bufs["w"], full)
    assert calls == [(r, [(0, 2, 3)]) for r in (1, 0, 2, 3)]


def test_ipc_session_steps_move_every_piece_and_sum_alike(monkeypatch):
    """`run_ipc` on every rank of a session at once, over a real rendezvous store, with CUDA's
    handle export and mapping replaced by an in-process table (no GPU here; `make gpu-check` runs
    the real ones): every destination piece holds its canonical values (computed apart from the
    plan), the sources' sums equal what landed, and each source waits for its readers."""
    import threading

    from reshard.common.dataplane import cuda_ipc
    from reshard.common.dataplane.backend import plan_options
    from reshard.common.dataplane.checksum import P
    from reshard.common.dataplane.transport import serve_store
    from reshard.common.models.frameworks import build
    from reshard.common.plan.planner import make_plan
    from tests.unit.colocation import assert_canonical, buffers, in_process_ipc

    in_process_ipc(monkeypatch, cuda_ipc)
    src, dst = build("tiny", "framework=megatron,tp=2"), build("tiny", "framework=vllm,tp=2,dp=2")
    plan = make_plan(src, dst, plan_options(0, "ipc"))
    shapes = {n: t.shape for n, t in src.tensors.items()}

    store, sock = serve_store("127.0.0.1", 10.0)
    S = src.world
    ranks = [("src", r, buffers(src, r, shapes, 9)) for r in range(S)] + [("dst", r, buffers(dst, r, shapes, None)) for r in range(dst.world)]
    results, errors = {}, []

    def run(side, rank, bufs):
        t = cuda_ipc.IpcTransport("127.0.0.1", sock.getsockname()[1], "s", rank if side == "src" else S + rank,
                                  S + dst.world, 10.0, device="cuda:0", key="k")
        t.device = torch.device("cpu")  # the buffers' device here
        try:
            results[(side, rank)] = cuda_ipc.run_ipc(t, "u1", plan, side, rank, bufs, shapes, dst, time.monotonic() + 20)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            t.close()

    threads = [threading.Thread(target=run, args=r) for r in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    left = [k for r in range(S + dst.world) for k in (f"u1/handles/{r}", f"u1/read/{r - S}") if store.check([f"reshard/k/ipc/{k}"])]
    sock.close()
    assert not errors, errors
    assert left == [f"u1/read/{d}" for d in range(dst.world)]  # handles deleted once read; one mark per reader
    sent: dict = {}
    for r in range(S):
        for k, v in results[("src", r)][0].items():
            sent[k] = (sent.get(k, 0) + v) % P
    landed = {k: v for r in range(dst.world) for k, v in results[("dst", r)][0].items()}
    assert sent == landed and landed
    for side, r, bufs in ranks[S:]:
        assert_canonical(dst, r, bufs, shapes, 9)
    assert sum(results[("dst", r)][1] for r in range(dst.world)) == plan.total_bytes


class _CopyStreamStuck(FakeCuda):
    """The copy stream never finishes (an unpack waits for a group whose peer froze): its
    synchronize blocks for 30 s, events recorded on it never complete; the comm stream's do."""

    def stream(self):
        s = super().stream()
        if s.name == "copy":
            s.synchronize = lambda: time.sleep(30)
        return s

    def event(self):
        ev = FakeEvent(self)
        query = ev.query
        ev.query = lambda: query() and ev.stream.name != "copy"
        return ev


def test_a_reused_session_waits_by_the_current_updates_deadline():
    """A session joined by an update with a 20 s deadline, reused by one with 0.3 s left (issue 28,
    item 11): the engine's last wait, for its copy stream, and a group still connecting before the
    next launch end at the current update's deadline and abort the session; neither waits out the
    joining update's deadline nor blocks for good."""
    from reshard.common.dataplane.engine import Engine

    plan, _, full, shapes = _relay_scene()
    lib, cuda = FakeNccl(), _CopyStreamStuck()
    t = _transport(lib, cuda, rank=0, world=4, timeout=20.0)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="copy stream was not done within the update's deadline"):
        Engine(t, plan, "src", 0, full, shapes, StagingPool(), time.monotonic() + 0.3).run()
    assert time.monotonic() - t0 < 1.5 and lib.aborted == 1

    lib = FakeNccl(group_end=7)  # ncclInProgress: the group's connections are being set up
    t = _transport(lib, rank=0, world=4, timeout=20.0)
    t.prepare_broadcast([(0, 1, 2, 3)], 0.3)  # the next update (the serialized baseline's first call)
    lib.async_codes = [7]  # and they never are
    t.send(torch.zeros(4, dtype=torch.uint8), 1, 0)
    t.flush()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="a group still connecting .*not done within 0.3s"):
        t.broadcast(torch.zeros(4, dtype=torch.uint8), (0, 1, 2, 3))
    assert time.monotonic() - t0 < 1.5 and lib.aborted == 1


# -- the strict fakes, and the bugs they catch (issue 28, item 29) -----------------------------------


def test_the_fakes_refuse_what_nccl_refuses_and_what_the_transport_must_not_do():
    import types

    lib, cuda = FakeNccl(), FakeCuda()
    comm_s, copy_s = cuda.stream(), cuda.stream()
    assert len({cuda.current.cuda_stream, comm_s.cuda_stream, copy_s.cuda_stream}) == 3  # a handle per stream
    buf = torch.zeros(8, dtype=torch.uint8)
    p = buf.data_ptr()
    with pytest.raises(NcclError, match=r"ncclGroupEnd failed: ncclInvalidUsage \(5\).*not in a group call"):
        lib.group_end()
    comm = lib.comm_init_rank(4, b"\0" * 128, 0)
    other = FakeNccl().comm_init_rank(4, b"\0" * 128, 1)
    assert comm.value != other.value and comm.value and other.value  # a handle per communicator
    lib.group_start()
    with pytest.raises(NcclError, match="ncclSend failed: ncclInvalidArgument .*before the previous operation returned"):
        lib.send(p, 8, 1, comm, comm_s.cuda_stream)  # the init is still in progress
    assert lib.comm_async_error(comm) == 0  # settled
    for stream, name in ((copy_s, "copy"), (cuda.current, "default")):
        with pytest.raises(FakeMisuse, match=f"ncclSend posted on the {name} stream"):
            lib.send(p, 8, 1, comm, stream.cuda_stream)
    with pytest.raises(NcclError, match="ncclUnhandledCudaError"):
        lib.send(p, 8, 1, comm, 0)  # no such stream
    with pytest.raises(NcclError, match="ncclInvalidArgument .*peer 4 out of range"):
        lib.recv(p, 8, 4, comm, comm_s.cuda_stream)
    with pytest.raises(NcclError, match="ncclInvalidArgument .*NULL"):
        lib.send(p, 8, 1, types.SimpleNamespace(value=None), comm_s.cuda_stream)
    with pytest.raises(FakeMisuse, match="did not make"):
        lib.send(p, 8, 1, other, comm_s.cuda_stream)
    lib.send(p, 8, 1, comm, comm_s.cuda_stream)
    assert lib.group_end() == 0 and lib.groups == [[Posted("send", 1, 8, "comm", "comm", 0)]]
    with pytest.raises(FakeMisuse, match="ncclRecv outside a group"):
        lib.recv(p, 8, 1, comm, comm_s.cuda_stream)
    lib.group_start()
    elsewhere = FakeCuda().stream()  # another transport's comm stream
    with pytest.raises(FakeMisuse, match="ncclSend posted on the comm stream"):
        lib.send(p, 8, 1, comm, elsewhere.cuda_stream)
    lib.group_end()

    ev = cuda.event()
    with pytest.raises(FakeMisuse, match="polls event .* never recorded"):
        ev.query()
    with pytest.raises(FakeMisuse, match="copy stream waits for event .* never recorded"):
        copy_s.wait_event(ev)
    ev.record(comm_s)
    with pytest.raises(FakeMisuse, match="waits for its own event"):
        comm_s.wait_event(ev)
    copy_s.wait_event(ev)
    with pytest.raises(FakeMisuse, match="another device"):
        cuda.event().record(FakeCuda().current)

    lib.comm_abort(comm)
    with pytest.raises(FakeMisuse, match="ncclCommFinalize on communicator comm after it was aborted"):
        lib.comm_finalize(comm)

    wire: dict = {}
    a, b = FakeNccl(wire=wire), FakeNccl(wire=wire)
    ca, cb = FakeCuda(), FakeCuda()
    sa, sb = ca.stream(), cb.stream()
    comms = [x.comm_init_rank(2, b"\0" * 128, r) for r, x in enumerate((a, b))]
    for x, c in zip((a, b), comms):
        x.comm_async_error(c)
    a.group_start()
    a.send(p, 8, 1, comms[0], sa.cuda_stream)
    a.group_end()
    b.group_start()
    with pytest.raises(FakeMisuse, match="rank 0 sent 8 bytes into a 4-byte receive"):
        b.recv(p, 4, 0, comms[1], sb.cuda_stream)
    with pytest.raises(FakeMisuse, match="rank 1 receives 8 bytes from rank 0, which sent nothing"):
        b.recv(p, 8, 0, comms[1], sb.cuda_stream)
    b.group_end()


class _PostsOnTheCallersStream:
    """A transport's comm stream but for the handle NCCL is given: the stream current when it posts
    (the bug of launching on `torch.cuda.current_stream()`, the copy stream inside the engine)."""

    def __init__(self, real, cuda):
        self._real, self._cuda = real, cuda

    def __getattr__(self, name):
        return getattr(self._real, name)

    @property
    def cuda_stream(self):
        return self._cuda.current_stream().cuda_stream


def test_negative_control_work_posted_on_the_callers_stream_fails():
    """The fake before gave every stream handle 0, so NCCL got the same handle whichever stream the
    transport named: both mutant runs below passed against it. The unchanged transport passes."""
    from reshard.common.dataplane.engine import Engine

    plan, _, full, shapes = _relay_scene()

    def session(mutant):
        lib, cuda = FakeNccl(), FakeCuda()
        t = _transport(lib, cuda, rank=0, world=4)
        if mutant:
            t.comm_stream = _PostsOnTheCallersStream(t.comm_stream, cuda)
        return lib, t

    lib, t = session(False)
    Engine(t, plan, "src", 0, full, shapes, StagingPool(), time.monotonic() + 5).run()
    t.send(torch.zeros(4, dtype=torch.uint8), 1, 0).wait(1.0)
    assert {(p.call, p.comm, p.stream) for p in lib.posted} == {("send", "comm", "comm")}
    assert len(lib.groups) == len({m.round for m in plan.sends[0]}) + 1

    _, t = session(True)
    with pytest.raises(FakeMisuse, match="ncclSend posted on the copy stream"):  # inside the engine's copy context
        Engine(t, plan, "src", 0, full, shapes, StagingPool(), time.monotonic() + 5).run()
    _, t = session(True)
    with pytest.raises(FakeMisuse, match="ncclSend posted on the default stream"):  # outside it
        t.send(torch.zeros(4, dtype=torch.uint8), 1, 0).wait(1.0)


def test_negative_control_a_launch_on_a_communicator_still_connecting_fails(monkeypatch):
    """NCCL refuses any call on a non-blocking communicator whose last call returned ncclInProgress
    until ncclCommGetAsyncError has seen it settle (ncclInvalidArgument). The transport settles a group
    still connecting before its next launch; a transport that skips that fails against the strict fake.
    The fake before took any call at any time, and the mutant passed."""

    def two_rounds(t):
        for peer in (1, 2):  # each group connects to a new peer: ncclInProgress
            t.send(torch.zeros(4, dtype=torch.uint8), peer, 0)
            t.flush()

    lib = FakeNccl(group_end=7)
    two_rounds(_transport(lib))
    assert [len(g) for g in lib.groups] == [1, 1]
    monkeypatch.setattr(NcclTransport, "_launching", lambda self: self._after_producer())  # no settling
    lib = FakeNccl(group_end=7)
    with pytest.raises(NcclError, match="ncclSend failed: ncclInvalidArgument .*before the previous operation returned"):
        two_rounds(_transport(lib))
    assert lib.aborted == 1  # a launch NCCL failed aborts the session


def test_negative_control_waiting_for_an_event_never_recorded_fails(monkeypatch):
    """A group's event that was made but never recorded on the comm stream: CUDA reports it complete at
    once and a stream waiting for it orders nothing, so the host would read a receive before it landed.
    The fake before said such an event was complete and logged the wait: the mutant passed."""
    lib = FakeNccl()
    t = _transport(lib)
    t.send(torch.zeros(4, dtype=torch.uint8), 1, 0).wait(1.0)
    monkeypatch.setattr(NcclTransport, "_record", lambda self: self._cuda.event())
    with pytest.raises(FakeMisuse, match="the host polls event .* never recorded"):
        t.send(torch.zeros(4, dtype=torch.uint8), 1, 0).wait(1.0)
    t = _transport(FakeNccl())
    w = t.recv(torch.zeros(4, dtype=torch.uint8), 1, 0)
    t.flush()
    with pytest.raises(FakeMisuse, match="the copy stream waits for event .* never recorded"):
        with t.copy_context():
            w.device_wait(1.0)


def test_negative_control_a_communicator_used_after_its_abort_fails(monkeypatch):
    """A transport that aborts its communicator but keeps the handle posts the next round on freed
    memory. The fake before took any call on any communicator: the mutant passed."""
    real = NcclTransport._abort

    def keeps_the_handle(self, why):
        comm = self._comm
        real(self, why)
        self._comm = comm

    monkeypatch.setattr(NcclTransport, "_abort", keeps_the_handle)
    lib = FakeNccl()
    t = _transport(lib)
    t.abort("update u9 aborted")
    with pytest.raises(FakeMisuse, match="ncclSend on communicator comm after it was aborted"):
        t.send(torch.zeros(4, dtype=torch.uint8), 1, 0).wait(1.0)


@pytest.mark.parametrize("launch", ["group", "broadcast", "split"])
def test_a_launch_that_nccl_fails_aborts_the_session(launch):
    """An error returned by a launch (ncclGroupEnd, ncclBroadcast, ncclCommSplit; not ncclInProgress)
    leaves the communicator failed, and NCCL says to abort it. The transport raised it and kept the
    session: later rounds were posted on the failed communicator and close() tried to finalize it."""
    lib = FakeNccl()
    t = _transport(lib)
    buf = torch.zeros(4, dtype=torch.uint8)
    if launch == "group":
        lib.group_end_code = 2
        act = lambda: t.send(buf, 1, 0).wait(1.0)  # noqa: E731
    elif launch == "broadcast":
        lib.broadcast = lambda *a: lib._fail("ncclBroadcast", 2, "")
        act = lambda: t.broadcast(buf, (0, 1, 2, 3)).wait(1.0)  # noqa: E731
    else:
        lib.comm_split = lambda *a: lib._fail("ncclCommSplit", 2, "")
        act = lambda: t.prepare_broadcast([(0, 1)], 1.0)  # noqa: E731
    with pytest.raises(NcclError, match="ncclSystemError"):
        act()
    assert lib.aborted == 1 and lib.aborted_comms == ["comm"]
    with pytest.raises(TransportError, match=r"unusable: .*ncclSystemError \(2\).*the communicator was aborted"):
        t.send(buf, 1, 0)
    t.close()
    assert ("finalize",) not in lib.calls and lib.destroyed == 0
