"""reshard on Ray: the two controllers as named, restartable Ray actors; the workers inside the
actors a framework already has (its trainer actor group, its vLLM engine actors).

    import ray
    from reshard.integrations.ray import RayDeployment

    dep = RayDeployment.start(trainer_workers=2, inference_workers=2, run="grpo")   # on the driver's node
    # in each trainer actor (FSDP2 rank r of 2):
    worker = dep.trainer_worker(model).start()          # or vLLM's trainer API: dep.trainer_init_info(rank=r)
    # to the vLLM engines (Ray actors, or a server): their init info
    llm.init_weight_transfer_engine({"init_info": dep.vllm_init_info()})
    ...
    dep.shutdown()

`RayDeployment` is a small value (addresses and where the credentials are): pass it to actors as an
argument, or find it by name from any process of the job (`RayDeployment.connect(name)`).

The controllers run in two actors pinned to one node (by default the caller's), each on fixed ports
chosen when it first starts, so an actor that Ray restarts comes back at the same addresses and
the workers reattach by themselves. A worker whose actor dies is a worker that died: the update in
flight fails within the worker timeout, and the next one succeeds once a worker holds that rank
again (a restarted actor builds its worker anew).

Security: on one host (every Ray node at the same address) the controllers listen on loopback.
A cluster over several hosts needs `credentials`: a folder written by `reshard certs --out DIR
--host <the controllers' node address>`, readable at the same path on every node (a shared volume
or a secret mounted alike); the controllers serve TLS with its certificate and accept its tokens,
and the workers present the worker token. Nothing here runs without them off loopback."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from typing import Any

DEFAULT_NAME = "reshard"
_HELD: dict[tuple, list] = {}  # the controllers' actor handles, held by the process that started them (see start)


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("reshard.integrations.ray needs Ray: pip install 'reshard[ray]'") from None
    return ray


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _node_ip() -> str:
    return _ray().util.get_node_ip_address()


class _Controller:
    """A reshard controller (trainer or inference) in this actor's process: its gRPC service and its
    worker listener served from a thread with an event loop of its own, until `stop`."""

    def __init__(self, role: str, spec: dict) -> None:
        os.environ.update(spec["env"])  # credentials: this process is the controller's alone
        from reshard.common.control.logs import configure
        from reshard.common.control.rpc import Deadlines, new_event_loop
        from reshard.common.control.tracing import configure_from_env

        configure(spec.get("log_level", "INFO"), role=role)
        configure_from_env(role)
        self.role, self.spec = role, spec
        deadlines = Deadlines(update_s=spec["update_timeout"], worker_s=spec["worker_timeout"])
        self._loop = new_event_loop()
        self._stop = None
        self._error: BaseException | None = None
        started = threading.Event()

        async def main() -> int:
            import asyncio

            self._stop = asyncio.Event()
            started.set()
            if role == "inference":
                from reshard.inference_svc.service import serve

                return await serve(spec["listen"], spec["workers"], spec["model"], deadlines=deadlines, stop=self._stop,
                                   spawn_workers=False, worker_listen=spec["worker_listen"])
            from reshard.trainer_svc.service import serve

            return await serve(spec["listen"], spec["workers"], spec["model"], [spec["inference"]], run=spec["run"],
                               deadlines=deadlines, stop=self._stop, spawn_workers=False, worker_listen=spec["worker_listen"],
                               store_host=spec["store_host"])

        def run() -> None:
            try:
                rc = self._loop.run_until_complete(main())
                if rc:
                    self._error = RuntimeError(f"the reshard {role} controller exited with status {rc} (see this actor's log)")
            except BaseException as e:  # noqa: BLE001 - reported by ready() and the actor's health
                self._error = e
            finally:
                started.set()

        self._thread = threading.Thread(target=run, name=f"reshard-{role}-controller", daemon=True)
        self._thread.start()
        started.wait()
        self._wait_listening(60.0)

    def _wait_listening(self, timeout: float) -> None:
        host, port = self.spec["listen"].rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while True:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the reshard {self.role} controller did not start: {self._error}")
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the reshard {self.role} controller did not listen on {self.spec['listen']} "
                                       f"within {timeout:.0f}s") from None
                time.sleep(0.1)

    def info(self) -> dict:
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the reshard {self.role} controller stopped: {self._error}")
        return {"listen": self.spec["listen"], "worker_listen": self.spec["worker_listen"], "pid": os.getpid(),
                "node_id": _ray().get_runtime_context().get_node_id()}

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)


@dataclasses.dataclass(frozen=True)
class RayDeployment:
    """Where a reshard deployment on Ray is: its controllers' addresses and credentials."""

    name: str
    namespace: str | None
    trainer: str  # the trainer controller's gRPC address (reshard update / status --trainer)
    inference: str  # the inference controller's
    trainer_workers: str  # the worker listeners: trainer ranks attach to the first, vLLM ranks to the second
    inference_workers: str
    credentials: str = ""  # a `reshard certs` folder, at the same path on every node ("" on one host)

    # -- start, find, stop ---------------------------------------------------------------
    @classmethod
    def start(cls, *, trainer_workers: int, inference_workers: int, run: str = "", name: str = DEFAULT_NAME,
              namespace: str | None = None, credentials: str = "", node_id: str | None = None, model: str = "",
              update_timeout: float = 120.0, worker_timeout: float = 5.0, max_restarts: int = -1,
              detached: bool = False) -> "RayDeployment":
        """Start both controllers as actors `<name>-trainer` and `<name>-inference` (restarted by Ray up
        to `max_restarts` times, -1: always) on `node_id` (default: this process's node), waiting for
        `trainer_workers` and `inference_workers` ranks of the framework's own actors. They live as
        long as the job that started them (until `shutdown`), or with `detached` beyond it (until
        `shutdown` from any job)."""
        ray = _ray()
        if not ray.is_initialized():
            raise RuntimeError("RayDeployment.start: call ray.init() first (this process joins the cluster)")
        if trainer_workers < 1 or inference_workers < 1:
            raise ValueError("RayDeployment.start: trainer_workers and inference_workers are 1 or more")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = node_id or ray.get_runtime_context().get_node_id()
        on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)  # a restart comes back here, at the same ports
        ip, ports = ray.get(ray.remote(num_cpus=0)(lambda: (_node_ip(), _free_ports(4))).options(
            scheduling_strategy=on_node).remote())
        env: dict[str, str] = {}
        if credentials:
            credentials = os.path.abspath(credentials)
            env = {"RESHARD_TLS_CERT": os.path.join(credentials, "server.pem"),
                   "RESHARD_TLS_KEY": os.path.join(credentials, "server-key.pem"),
                   "RESHARD_TLS_CA": os.path.join(credentials, "ca.pem"), "RESHARD_TOKENS_DIR": credentials}
            host = ip
        else:
            hosts = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
            if hosts != {ip}:
                raise ValueError(f"this Ray cluster spans hosts {sorted(hosts)}: reshard's controllers would listen off "
                                 "loopback, which needs credentials (reshard certs --out DIR --host "
                                 f"{ip}; RayDeployment.start(credentials=DIR), DIR at the same path on every node)")
            host = "127.0.0.1"
        addr = [f"{host}:{p}" for p in ports]
        base = {"env": env, "update_timeout": update_timeout, "worker_timeout": worker_timeout, "model": model}
        for role in ("trainer", "inference"):
            try:
                ray.get_actor(f"{name}-{role}", namespace=namespace)
            except ValueError:
                continue
            raise ValueError(f"a reshard deployment named {name!r} already runs ({name}-{role}): "
                             "RayDeployment.connect(name) finds it; shutdown() stops it")
        Actor = ray.remote(num_cpus=0, max_restarts=max_restarts, max_task_retries=0, max_concurrency=4)(_Controller)
        opts = dict(namespace=namespace, scheduling_strategy=on_node, lifetime="detached" if detached else None)
        inf = Actor.options(name=f"{name}-inference", **opts).remote(
            "inference", {**base, "listen": addr[0], "worker_listen": addr[1], "workers": inference_workers})
        inf_info = ray.get(inf.info.remote())  # listening: the trainer controller may call it
        tr = Actor.options(name=f"{name}-trainer", **opts).remote(
            "trainer", {**base, "listen": addr[2], "worker_listen": addr[3], "workers": trainer_workers,
                        "inference": addr[0], "run": run, "store_host": host})
        ray.get(tr.info.remote())
        if not detached:  # a job's named actor lives while a handle does: this process holds them
            _HELD[(namespace, name)] = [inf, tr]
        return cls(name, namespace, addr[2], inf_info["listen"], addr[3], inf_info["worker_listen"], credentials)

    @classmethod
    def connect(cls, name: str = DEFAULT_NAME, namespace: str | None = None, credentials: str = "") -> "RayDeployment":
        """The deployment whose controllers run as `<name>-trainer` and `<name>-inference`."""
        ray = _ray()
        tr = ray.get(ray.get_actor(f"{name}-trainer", namespace=namespace).info.remote())
        inf = ray.get(ray.get_actor(f"{name}-inference", namespace=namespace).info.remote())
        return cls(name, namespace, tr["listen"], inf["listen"], tr["worker_listen"], inf["worker_listen"], credentials)

    def actors(self) -> dict[str, Any]:
        ray = _ray()
        return {role: ray.get_actor(f"{self.name}-{role}", namespace=self.namespace) for role in ("trainer", "inference")}

    def pids(self) -> dict[str, int]:
        """The controllers' processes (their actors')."""
        ray = _ray()
        return {role: ray.get(a.info.remote())["pid"] for role, a in self.actors().items()}

    def shutdown(self) -> None:
        """Stop both controllers and their actors (no restart)."""
        ray = _ray()
        for role in ("trainer", "inference"):
            try:
                actor = ray.get_actor(f"{self.name}-{role}", namespace=self.namespace)
            except ValueError:
                continue  # already gone
            try:
                ray.get(actor.stop.remote(), timeout=40)
            except Exception:  # noqa: BLE001 - it is killed below all the same
                pass
            ray.kill(actor, no_restart=True)
        _HELD.pop((self.namespace, self.name), None)

    # -- what the framework's actors use ---------------------------------------------------
    def worker_credentials(self) -> dict[str, str]:
        """`token` and `tls_ca` for a worker (empty on one host)."""
        if not self.credentials:
            return {}
        with open(os.path.join(self.credentials, "worker.token")) as f:
            token = f.read().strip()
        return {"token": token, "tls_ca": os.path.join(self.credentials, "ca.pem")}

    def security(self):
        """The worker's credentials as a reshard Security (for TrainerWorker / InferenceWorker; None: the
        process's own, from its environment)."""
        from reshard.common.control.security import Security

        c = self.worker_credentials()
        if not c:
            return None
        return dataclasses.replace(Security.from_env(ca=c["tls_ca"]), tokens=(("worker", c["token"]),))

    def trainer_worker(self, module, **kw):
        """A TrainerWorker for this rank of the framework's trainer (call `.start()`)."""
        from reshard.trainer_svc.worker import TrainerWorker

        return TrainerWorker.from_module(self.trainer_workers, module, security=self.security(), **kw)

    def trainer_init_info(self, *, rank: int, **kw):
        """vLLM's trainer API: the init info of `WeightTransferTrainerFactory.trainer_init`."""
        from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo

        c = self.worker_credentials()
        engine = {**kw.pop("engine", {}), **c}
        return ReshardTrainerInitInfo(rank=rank, trainer=self.trainer_workers, controller=self.inference_workers,
                                      engine=engine, **c, **kw)

    def vllm_init_info(self, **engine) -> dict[str, Any]:
        """The init info of vLLM's `init_weight_transfer_engine` for the `reshard` backend."""
        return {"controller": self.inference_workers, **self.worker_credentials(), **engine}
