"""Real services in real processes, driven through the CLI, for integration tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from reshard.common.models.presets import model_config
from reshard.tools.synth import tensor_value

CHECKPOINT_STEP = 0


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a service binds it seconds later (after its
    imports), and meanwhile the test's own outbound connections (workers retrying their controller)
    take ephemeral ports, which could be this one."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dump_rpc(addr: str, name: str, rank: int | None = None) -> tuple[torch.Tensor, dict]:
    """A tensor read back through the inference controller's Dump RPC, in this process (what
    `reshard dump` calls, without starting a process that imports torch for every tensor)."""
    import grpc

    from reshard.common.layout.core import dtype_of
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    data, first = bytearray(), None
    req = pb.DumpRequest(tensor=name) if rank is None else pb.DumpRequest(tensor=name, rank=rank)
    with grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        try:
            for chunk in rgrpc.InferenceServiceStub(ch).Dump(req, timeout=60):
                first = first or chunk
                assert chunk.offset == len(data)
                data += chunk.data
        except grpc.RpcError as e:
            raise AssertionError(f"dump {name} from {addr}: {e.code().name}: {e.details()}") from None
    t = torch.frombuffer(data, dtype=dtype_of(first.dtype)).view(list(first.shape)).clone()
    return t, {"run": first.version.run, "step": first.version.step}


def stop_processes(procs: list[subprocess.Popen], grace: float = 20) -> None:
    """SIGTERM each still running; SIGKILL the process group of any that ignores it."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def live_members(pgid: int) -> list[int]:
    """Processes of a process group that have not exited (zombies waiting for init do not count)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def cli(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "reshard.cli", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"reshard {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r


class Cluster:
    """One inference_svc and one trainer_svc with standalone synthetic workers."""

    def __init__(self, model: str = "small", *, inference_workers: int = 4, trainer_workers: int = 2,
                 trainer_model: str | None = None, update_timeout: float = 60, bucket_bytes: int = 0,
                 inference_env: dict | None = None, inference_staging: str = "shadow", layout_fault: str = "", seed: int = 0,
                 trainer_layout: str = "", inference_layout: str = "", trainer_args: tuple[str, ...] = (),
                 inference_args: tuple[str, ...] = ()):
        self.model, self.seed = model, seed
        self.inf = f"127.0.0.1:{free_port()}"
        self.tr = f"127.0.0.1:{free_port()}"
        self.logdir = tempfile.mkdtemp(prefix="reshard-it-")
        env = dict(os.environ, RESHARD_LOG_LEVEL="INFO", **(inference_env or {}))
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "reshard.cli", "inference", "--listen", self.inf,
                              *(["--layout", inference_layout] if inference_layout else ["--workers", str(inference_workers)]),
                              "--model", model, "--seed", str(seed), "--staging", inference_staging,
                              "--update-timeout", str(update_timeout),
                              *inference_args],
                             env=env, stdout=subprocess.DEVNULL, stderr=open(f"{self.logdir}/inference.log", "w"), start_new_session=True),
        ]
        tr = [sys.executable, "-m", "reshard.cli", "trainer", "--listen", self.tr,
              *(["--layout", trainer_layout] if trainer_layout else ["--workers", str(trainer_workers)]),
              "--model", trainer_model or model, "--inference", self.inf, "--seed", str(seed), "--run", "run1",
              "--update-timeout", str(update_timeout)]
        if bucket_bytes:
            tr += ["--bucket-bytes", str(bucket_bytes)]
        if layout_fault:
            tr += ["--layout-fault", layout_fault]
        tr += list(trainer_args)
        self._trainer_cmd = tr
        self.procs.append(self._start_trainer(tr))
        self.wait_serving()

    def _start_trainer(self, cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=dict(os.environ, RESHARD_LOG_LEVEL="INFO"), stdout=subprocess.DEVNULL,
                                stderr=open(f"{self.logdir}/trainer.log", "a"), start_new_session=True)

    def restart_trainer(self, *extra: str) -> None:
        """Stop trainer_svc (SIGTERM: it stops its workers) and start it again, same run, with `extra`
        arguments on top of the first ones (e.g. another --transfer-method)."""
        old = self.procs[1]
        old.send_signal(signal.SIGTERM)
        old.wait(20)
        self.procs[1] = self._start_trainer(self._trainer_cmd + list(extra))
        self.wait_serving()

    def logs(self) -> str:
        out = []
        for name in ("inference", "trainer"):
            with open(f"{self.logdir}/{name}.log") as f:
                out.append(f"--- {name} ---\n" + f.read()[-6000:])
        return "\n".join(out)

    def status(self, side: str = "inference") -> dict:
        """GetStatus over gRPC from this process (the CLI's `status --json` prints the same fields;
        a direct call keeps polling fast enough to strike while a transfer is running)."""
        import grpc
        from google.protobuf import json_format

        from reshard.proto import reshard_pb2 as pb
        from reshard.proto import reshard_pb2_grpc as rgrpc

        addr = self.inf if side == "inference" else self.tr
        with grpc.insecure_channel(addr) as ch:
            stub = rgrpc.InferenceServiceStub(ch) if side == "inference" else rgrpc.TrainerServiceStub(ch)
            try:
                st = stub.GetStatus(pb.StatusRequest(), timeout=10)
            except grpc.RpcError as e:
                raise RuntimeError(str(e)) from None
        return json_format.MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def wait_for(self, pred, timeout: float = 90, side: str = "inference", what: str = "condition") -> dict:
        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout:
            try:
                last = self.status(side)
                if pred(last):
                    return last
            except RuntimeError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last status {last}\n{self.logs()}")

    def wait_serving(self) -> None:
        self.wait_for(lambda s: s["serving_state"] == "SERVING", what="inference SERVING")
        self.wait_for(lambda s: s["serving_state"] == "SERVING", side="trainer", what="trainer workers attached")

    def update(self, *extra: str, timeout: float = 120) -> tuple[int, dict | None, str]:
        r = cli("update", "--trainer", self.tr, "--wait", "--json", *extra, timeout=timeout)
        try:
            out = json.loads(r.stdout) if r.stdout.strip() else None
        except ValueError:
            out = None
        return r.returncode, out, r.stderr

    def dump(self, tensor: str, rank: int | None = None) -> tuple[torch.Tensor, dict]:
        return dump_rpc(self.inf, tensor, rank)

    def expected(self, tensor: str, step: int) -> torch.Tensor:
        spec = model_config(self.model).tensors()[tensor]
        return tensor_value(self.seed, tensor, step, spec.shape, torch.bfloat16)

    def worker_pid(self, rank: int) -> int:
        st = self.status()
        return int(next(w for w in st["workers"] if w["rank"] == rank)["pid"])

    def close(self) -> list[int | None]:
        """SIGTERM both services; returns their exit codes (None: had to be killed)."""
        codes: list[int | None] = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                codes.append(p.wait(20))
            except subprocess.TimeoutExpired:
                codes.append(None)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in self.procs:  # anything the services left behind
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return codes

    def leftover_processes(self) -> list[str]:
        """Processes still running that were started for this cluster (workers included)."""
        ports = (self.inf.rsplit(":", 1)[1], self.tr.rsplit(":", 1)[1])
        r = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
        return [line for line in r.stdout.splitlines() if "reshard" in line and any(f":{p} " in line + " " for p in ports)]


# Tensors checked after every update: fused and interleaved on the trainer, fused on
# inference, replicated KV heads, padded vocabulary, replicated norms.
CHECKED = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.2.mlp.gate_proj.weight",
    "model.layers.3.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.2.input_layernorm.weight",
]
