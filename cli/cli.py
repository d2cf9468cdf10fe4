"""The `reshard` command line: services, operator commands and the demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time

import grpc

from reshard.common.control.rpc import Deadlines, channel, parse_address, status_error
from reshard.common.control.security import FLAG_ENV, Security, SecurityError, current
from reshard.common.dataplane.backend import BACKENDS
from reshard.inference_svc.stagings import STANDALONE
from reshard.common.models.presets import MODELS

DEFAULT_MODEL = "llama-1g"
log = logging.getLogger("reshard.cli")


def add_client_flags(p) -> None:
    """The credentials flags of every command that calls a service (each also read from the environment)."""
    p.add_argument("--tls-ca", default=None, help="CA certificate that signs the services' certificates (RESHARD_TLS_CA); "
                                                  "with it, calls use TLS")
    p.add_argument("--tls-cert", default=None, help="this process's certificate, for mutual TLS (RESHARD_TLS_CERT)")
    p.add_argument("--tls-key", default=None, help="the key of --tls-cert (RESHARD_TLS_KEY)")
    p.add_argument("--token-file", default=None,
                   help="bearer tokens, one `role token` per line (RESHARD_TOKEN_FILE; or RESHARD_TOKEN_<ROLE>)")


def add_server_flags(p) -> None:
    add_client_flags(p)
    p.add_argument("--tokens-dir", default=None,
                   help="the tokens this service accepts: DIR/operator.token, admin.token, peer.token, worker.token "
                        "(RESHARD_TOKENS_DIR; `reshard certs` writes them)")
    p.add_argument("--mtls", action="store_true", help="require client certificates signed by --tls-ca (RESHARD_MTLS=1)")
    p.add_argument("--insecure", action="store_true",
                   help="allow plaintext or unauthenticated calls off loopback (RESHARD_INSECURE=1): a trusted network only")


def apply_flags(a) -> Security:
    """Put a command's credential flags into this process's environment (its standalone workers
    inherit them) and return the credentials. Raises SecurityError."""
    for attr, var in FLAG_ENV.items():
        v = getattr(a, attr, None)
        if v:
            os.environ[var] = os.path.abspath(v)
    for attr, var in (("mtls", "RESHARD_MTLS"), ("insecure", "RESHARD_INSECURE")):
        if getattr(a, attr, False):
            os.environ[var] = "1"
    if getattr(a, "allow_peer", None):
        os.environ["RESHARD_ALLOW_PEERS"] = ",".join(a.allow_peer)
    return current()


def _worker_address(v: str) -> str:
    from reshard.common.control.rpc import parse_target

    try:
        parse_target(v, "worker listen address")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


def _address(what: str):
    def parse(s: str) -> str:
        try:
            parse_address(s, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return s
    return parse


def _model_names() -> list[str]:
    from reshard.common.models.frameworks import MODEL_SPECS

    return list(MODEL_SPECS)


def _layout_spec(s: str) -> str:
    from reshard.common.models.frameworks import parse_spec

    if s:
        try:
            parse_spec(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _device(s: str) -> str:
    s = s.strip()
    if s in ("cpu", "cuda") or (s.startswith("cuda:") and s[5:].isdigit()):
        return s
    raise argparse.ArgumentTypeError(f"device must be cpu, cuda or cuda:N, not {s!r}")


def _pool_bytes(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a whole number of bytes") from None
    if n < 1 << 20:
        raise argparse.ArgumentTypeError(f"{n} bytes is under 1 MiB: a pool must hold at least a bucket")
    return n


def _positive(s: str) -> float:
    v = float(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="reshard", description="Parallel weight resharding for disaggregated RL")
    ap.add_argument("--log-level", type=_log_level, default=os.environ.get("RESHARD_LOG_LEVEL", "INFO"))
    ap.add_argument("--log-format", choices=["text", "json"], default=os.environ.get("RESHARD_LOG_FORMAT", "text") or "text",
                    help="text, or json: one object per line, with the update id, version and deployment on every line "
                         "of an update (RESHARD_LOG_FORMAT; standalone workers follow it)")
    sub = ap.add_subparsers(dest="command", required=True)

    def service_args(p, workers: str) -> None:
        """What both services take: where external workers come from, the device, the deadlines."""
        p.add_argument("--external-workers", action="store_true",
                       help=f"start no workers: wait for --workers {workers} to attach")
        p.add_argument("--device", type=_device, default="cpu",
                       help="where standalone workers keep the weights: cpu, cuda (worker rank %% GPU count) or cuda:N")
        p.add_argument("--rpc-timeout", type=_positive, default=10.0, help="deadline of control-plane calls, seconds")
        p.add_argument("--update-timeout", type=_positive, default=120.0, help="deadline of one whole update, seconds")
        p.add_argument("--worker-listen", type=_worker_address, default=None,
                       help="where the workers attach (the worker protocol, never on --listen): HOST:PORT, or "
                            "unix:/PATH (default: a Unix socket in the private run folder, printed at start and in "
                            "`reshard status`; embedded workers on other hosts need HOST:PORT)")
        p.add_argument("--worker-timeout", type=_positive, default=5.0,
                       help="a worker silent this long (frozen) fails the update in flight, seconds")
        p.add_argument("--metrics-listen", type=_address("metrics listen address"), default=None,
                       help="serve Prometheus metrics on HOST:PORT/metrics (off by default; off loopback it needs TLS "
                            "and tokens like --listen, and a scrape an operator's token: docs/operations.md)")
        add_server_flags(p)

    models = sorted(MODELS)
    model_help = (f"standalone workers' model: {', '.join(models)} (default {DEFAULT_MODEL}); "
                  "with --external-workers only a label, the workers declare their own layout")
    p = sub.add_parser("inference", help="run inference_svc with standalone synthetic workers")
    p.add_argument("--listen", type=_address("listen address"), required=True)
    p.add_argument("--workers", type=int, default=None, help="workers (default: the layout's ranks, or 4)")
    p.add_argument("--layout", type=_layout_spec, default="",
                   help="standalone workers' layout, e.g. framework=vllm,tp=2,dp=2 (default: vllm TP over all workers)")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--staging", choices=STANDALONE, default=None,
                   help="standalone workers' staging (default shadow; bounded: no copy, received through a pool of "
                        "--pool-bytes); embedded workers choose their own "
                        "(InferenceWorker staging=, the vLLM backend's init info), which the controller reads from them")
    p.add_argument("--pool-bytes", type=_pool_bytes, default=256 << 20,
                   help="standalone workers staging bounded: the pool each receives through (default 256 MiB)")
    p.add_argument("--mode", dest="deprecated_mode", choices=["shadow", "inplace"], default=None,
                   help=argparse.SUPPRESS)  # the earlier name of --staging: still taken, with a warning
    service_args(p, "InferenceWorkers embedded in a serving engine")
    p.add_argument("--allow-peer", action="append", default=[],
                   help="with --mtls: a trainer identity (name in its client certificate) that may push here; repeat "
                        "(RESHARD_ALLOW_PEERS, comma-separated; default: any certificate the CA signed)")

    p = sub.add_parser("trainer", help="run trainer_svc with standalone synthetic workers")
    p.add_argument("--listen", type=_address("listen address"), required=True)
    p.add_argument("--workers", type=int, default=None, help="workers (default: the layout's ranks, or 2)")
    p.add_argument("--layout", type=_layout_spec, default="",
                   help="standalone workers' layout, e.g. framework=megatron,tp=2,pp=2 (default: megatron TP over all workers)")
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--inference", type=_address("inference address"), action="append", default=[],
                   help="an inference deployment to update (repeat for several; more can be attached later)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run", default="", help="run id (default: a fresh one; give the same one to resume a run: "
                                             "inference refuses another run without --allow-rollback)")
    p.add_argument("--allow-rollback", action="store_true",
                   help="let inference move to another run or back in steps (recorded in its history); "
                        "without it such an update is refused")
    p.add_argument("--bucket-bytes", type=int, default=0, help="staging bucket size (default 16 MiB)")
    p.add_argument("--store-host", default="",
                   help="host the workers use to reach this trainer's session store (default: the --listen host, "
                        "or 127.0.0.1 when it is a wildcard)")
    p.add_argument("--layout-fault", default="", choices=["", "swap-kv"], help=argparse.SUPPRESS)
    p.add_argument("--master-dtype", default="", choices=["", "float32", "bfloat16", "float16"],
                   help="standalone workers hold the weights in this dtype (e.g. float32 masters); a declared cast "
                        "to the inference dtype, done on the sender")
    p.add_argument("--backend", choices=list(BACKENDS), default="auto",
                   help="data plane (auto): ipc (CUDA IPC) when every worker's buffers are on one GPU, hybrid (NCCL "
                        "between GPUs, CUDA IPC within one) when some share a GPU, nccl when each has its own, gloo "
                        "when on CPU; or forced")
    p.add_argument("--transfer-method", default="reshard",
                   help="how every update moves: reshard (default), or a method a measurement tool plugs in "
                        "(serialized: the serialized baseline `reshard demo` compares against)")
    service_args(p, "TrainerWorkers embedded in a training job")

    p = sub.add_parser("update", help="push the trainer's latest version to inference (standalone workers: "
                                      "after a simulated optimizer step)")
    p.add_argument("--trainer", type=_address("trainer address"), required=True)
    p.add_argument("--wait", action="store_true", help="wait until it (or a newer version) is committed")
    p.add_argument("--json", action="store_true")
    p.add_argument("--tensors", default="",
                   help="a partial update: comma-separated canonical names or patterns (e.g. 'model.layers.*.mlp.*'); "
                        "the others keep their committed values")
    p.add_argument("--timeout", type=_positive, default=300.0)
    add_client_flags(p)

    for verb in ("attach", "detach"):
        p = sub.add_parser(verb, help=f"{verb} an inference deployment {'to' if verb == 'attach' else 'from'} a trainer")
        p.add_argument("--trainer", type=_address("trainer address"), required=True)
        p.add_argument("--inference", type=_address("inference address"), required=True)
        p.add_argument("--timeout", type=_positive, default=10.0)
        add_client_flags(p)

    p = sub.add_parser("status", help="what a service serves, its update in progress, workers, errors")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--trainer", type=_address("trainer address"))
    g.add_argument("--inference", type=_address("inference address"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=_positive, default=10.0)
    p.add_argument("--watch", type=_positive, nargs="?", const=1.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 1) in place: the update in flight with its byte rate, versions "
                        "and lag per deployment, unhealthy workers; Ctrl-C stops")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after this many refreshes")
    add_client_flags(p)

    p = sub.add_parser("dump", help="reassemble a canonical tensor from the inference workers")
    p.add_argument("--inference", type=_address("inference address"), required=True)
    p.add_argument("--tensor", required=True)
    p.add_argument("--out", required=True, help="output file (torch.save of the tensor)")
    p.add_argument("--rank", type=int, default=None, help="read from this worker only (it must hold the whole tensor)")
    p.add_argument("--timeout", type=_positive, default=60.0)
    add_client_flags(p)

    p = sub.add_parser("plan", help="plan a layout pair and print its figures (no data moves)")
    p.add_argument("--model", required=True, help="model shape: " + ", ".join(sorted(_model_names())))
    p.add_argument("--src", type=_layout_spec, required=True, help="e.g. framework=megatron,tp=1,pp=4,dp=32,ep=16")
    p.add_argument("--dst", type=_layout_spec, required=True, help="e.g. framework=vllm,tp=8,dp=16")
    p.add_argument("--bucket-bytes", type=int, default=0)
    p.add_argument("--no-relay", action="store_true", help="plan every replica from the trainer (no replica relays)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("doctor", help="what the data plane can use here: torch, CUDA, NCCL library and version, gloo")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("demo", help="the embedded local default: 2 trainer -> 4 inference workers on 127.0.0.1; "
                       "--engine vllm: an FSDP2 trainer -> real vLLM")
    p.add_argument("--engine", choices=("reshard", "vllm"), default="reshard",
                   help="reshard: synthetic workers of both services (default); vllm: an FSDP2 trainer (2 ranks) "
                        "training a Llama pushes into vLLM (TP 2) through the reshard backend, against the "
                        "gather-and-load path (needs the vllm extra)")
    p.add_argument("--vllm-model", choices=("llama-0.5g", "llama-tiny"), default="llama-0.5g",
                   help="with --engine vllm: the model trained and served")
    p.add_argument("--staging", choices=("bounded", "staged", "shadow"), default="bounded",
                   help="with --engine vllm: how the vLLM ranks stage updates (bounded, the default: no copy of the "
                        "weights, through a pool of --pool-bytes, inside update_weights; staged: one copy "
                        "(--staging-device), received while vLLM serves; shadow: two copies)")
    p.add_argument("--staging-device", choices=("host", "device"), default="host",
                   help="with --engine vllm --staging staged: where the copy lives (host: received through a pool "
                        "of --pool-bytes; device: straight into it); on vLLM's CPU build both are host memory")
    p.add_argument("--pool-bytes", type=_pool_bytes, default=128 << 20,
                   help="with --engine vllm, bounded or staged in host memory: the pool each rank receives through "
                        "(default 128 MiB)")
    p.add_argument("--model", choices=models, default=DEFAULT_MODEL)
    p.add_argument("--updates", type=int, default=4, help="reshard updates (the first is cold)")
    p.add_argument("--baseline-updates", type=int, default=3, help="serialized baseline updates (the first is cold)")
    p.add_argument("--fixed-cost-updates", type=int, default=3,
                   help="partial updates of the model's smallest tensor after the full ones: the fixed cost per update "
                        "(fixed_cost_s, their median); 0: none")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trainer-workers", type=int, default=2)
    p.add_argument("--inference-workers", type=int, default=4)
    from reshard.tools.rl_loop import add_arguments as rl_arguments

    rl_arguments(p)

    from reshard.tools.bench import add_parser as bench_parser
    from reshard.certs import add_parser as certs_parser
    from reshard.tools.chaos import add_parser as chaos_parser
    from reshard.tools.control_scale import add_parser as control_scale_parser
    from reshard.simulate_cmd import add_parser as simulate_parser

    bench_parser(sub)
    control_scale_parser(sub)
    simulate_parser(sub)
    chaos_parser(sub)
    certs_parser(sub)
    return ap


def message_to_dict(msg) -> dict:
    """A protobuf message as the CLI prints it in JSON: the .proto's field names, every field,
    and 64-bit integers as JSON numbers (the proto3 JSON mapping writes them as strings)."""
    from google.protobuf import json_format

    d = json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _int64_as_numbers(msg.DESCRIPTOR, d)


def _int64_as_numbers(desc, d: dict) -> dict:
    for name, v in d.items():
        f = desc.fields_by_name.get(name)
        if f is not None:
            d[name] = _field_value(f, v)
    return d


def _field_value(f, v):
    from google.protobuf.descriptor import FieldDescriptor as F

    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        value = f.message_type.fields_by_name["value"]
        return {k: _field_value(value, x) for k, x in v.items()}
    if isinstance(v, list):  # a repeated field
        return [_field_value(f, x) for x in v]
    if f.type in (F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64):
        return int(v)
    # Well-known types (google.protobuf.*) keep their own JSON form.
    if f.type == F.TYPE_MESSAGE and not f.message_type.full_name.startswith("google.protobuf."):
        return _int64_as_numbers(f.message_type, v)
    return v


async def cmd_update(a) -> int:
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    async with channel(a.trainer) as ch:
        stub = rgrpc.TrainerServiceStub(ch)
        try:
            tensors = [t.strip() for t in a.tensors.split(",") if t.strip()]
            rep = await stub.TriggerUpdate(pb.TriggerUpdateRequest(tensors=tensors),
                                           timeout=a.timeout)
        except grpc.aio.AioRpcError as e:
            print(f"update failed: {status_error(e)}", file=sys.stderr)
            return 2
        if not a.wait:
            print(json.dumps({"version": message_to_dict(rep.version)}) if a.json else f"requested {rep.version.run}:{rep.version.step}")
            return 0
        try:
            out = await stub.WaitForVersion(pb.WaitForVersionRequest(version=rep.version, timeout_s=a.timeout), timeout=a.timeout + 5)
        except grpc.aio.AioRpcError as e:
            print(f"update {rep.version.run}:{rep.version.step} failed: {status_error(e)}", file=sys.stderr)
            return 2
    if a.json:
        print(json.dumps({"ok": out.ok, "requested": message_to_dict(rep.version), "committed": message_to_dict(out.committed) if out.ok else None,
                          "superseded": out.superseded, "error": out.error, "seconds": out.record.seconds, "bytes": out.record.bytes,
                          "verified": out.record.verified}))
    elif out.ok:
        extra = f" (superseded {rep.version.run}:{rep.version.step})" if out.superseded else ""
        print(f"committed {out.committed.run}:{out.committed.step}{extra}")
    if not out.ok:
        print(f"update {rep.version.run}:{rep.version.step} failed: {out.error}", file=sys.stderr)
        return 1
    return 0


async def cmd_attach(a) -> int:
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    async with channel(a.trainer) as ch:
        stub = rgrpc.TrainerServiceStub(ch)
        call = stub.AttachInference if a.command == "attach" else stub.DetachInference
        try:
            rep = await call(pb.AttachRequest(address=a.inference), timeout=a.timeout)
        except grpc.aio.AioRpcError as e:
            print(f"{a.command} failed: {status_error(e)}", file=sys.stderr)
            return 2
    print("attached deployments: " + (", ".join(rep.deployments) or "none"))
    return 0


async def cmd_status(a) -> int:
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    addr = a.trainer or a.inference
    async with channel(addr) as ch:
        stub = rgrpc.TrainerServiceStub(ch) if a.trainer else rgrpc.InferenceServiceStub(ch)
        if getattr(a, "watch", None) is not None:
            return await _watch_status(a, stub, pb)
        try:
            st = await stub.GetStatus(pb.StatusRequest(), timeout=a.timeout)
        except grpc.aio.AioRpcError as e:
            print(f"status failed: {status_error(e)}", file=sys.stderr)
            return 2
    if a.json:
        print(json.dumps(message_to_dict(st)))
        return 0
    print("\n".join(status_lines(st)))
    return 0


async def _watch_status(a, stub, pb) -> int:
    """`status --watch`: the status again every `a.watch` seconds, redrawn in place on a terminal
    (blocks one after another otherwise), with the byte rate of the update in flight; until
    Ctrl-C, or `--count` refreshes."""
    tty = sys.stdout.isatty()
    last: tuple[float, str, int] | None = None  # (when, update, bytes done)
    n = 0
    try:
        count = getattr(a, "count", None)
        while count is None or n < count:
            n += 1
            try:
                st = await stub.GetStatus(pb.StatusRequest(), timeout=a.timeout)
                now = time.monotonic()
                p = st.progress
                key = f"{p.version.run}:{p.version.step}"
                rate = None
                if st.update_in_progress and last is not None and last[1] == key and now > last[0]:
                    rate = (p.bytes_done - last[2]) / (now - last[0])
                last = (now, key, p.bytes_done) if st.update_in_progress else None
                lines = status_lines(st, rate)
            except grpc.aio.AioRpcError as e:
                lines = [f"status failed: {status_error(e)}"]
            head = f"reshard status {a.trainer or a.inference} at {time.strftime('%H:%M:%S')} (every {a.watch:g} s, Ctrl-C stops)"
            if a.json:
                print(json.dumps(message_to_dict(st)) if lines and not lines[0].startswith("status failed") else
                      json.dumps({"error": lines[0]}), flush=True)
            else:
                print(("\x1b[H\x1b[2J" if tty else ("\n" if n > 1 else "")) + "\n".join([head, *lines]), flush=True)
            if count is None or n < count:
                await asyncio.sleep(a.watch)
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0


def status_lines(st, rate: float | None = None) -> list[str]:
    """A status as the operator reads it: versions and lag per deployment, the update in flight
    (phase, bytes, rate), unhealthy workers first, then every worker."""
    out = []
    v = f"{st.version.run}:{st.version.step}" if st.has_version else "none"
    out.append(f"{st.role} ({st.model}): {'published' if st.role == 'trainer' else 'serving'} {v}, state {st.serving_state}")
    if st.role == "trainer":
        out.append(f"  committed on inference: {st.committed.run}:{st.committed.step}" if st.has_committed
                   else "  committed on inference: none")
        for d in st.deployments:
            dv = f"{d.committed.run}:{d.committed.step}" if d.has_committed else "none"
            lag = f", {st.version.step - d.committed.step} steps behind" if d.has_committed and st.has_version else ""
            out.append(f"  deployment {d.address}: committed {dv}{lag}, {d.phase}" +
                       (f", last error: {d.last_error}" if d.last_error else ""))
    p = st.progress
    if st.update_in_progress:
        pct = 100.0 * p.bytes_done / p.bytes_total if p.bytes_total else 0.0
        out.append(f"  update {p.version.run}:{p.version.step}: {p.phase} {p.bytes_done}/{p.bytes_total} bytes ({pct:.0f}%)"
                   + (f", {rate / 1e6:.1f} MB/s" if rate is not None else "") + (f": {p.detail}" if p.detail else ""))
    if st.last_error:
        out.append(f"  last error: {st.last_error}")
    if st.worker_address:
        out.append(f"  workers attach at {st.worker_address}")
    unhealthy = [w for w in st.workers if w.state not in ("READY", "BUSY")]
    if unhealthy:
        out.append("  unhealthy workers: " + ", ".join(f"{w.rank} ({w.state})" for w in unhealthy))
    for w in st.workers:
        wv = f"{w.version.run}:{w.version.step}" if w.has_version else "none"
        out.append(f"  worker {w.rank}: {w.state} pid {w.pid} version {wv}" + (f" requests {w.requests_served}" if st.role == "inference" else "")
                   + (f"\n    {w.detail}" if w.detail else ""))
    if st.role == "inference":
        out.append(f"  requests served: {st.requests_served} ({st.requests_during_updates} during updates)")
        by: dict[str, int] = {}
        for w in st.workers:
            for k, n in w.requests_by_version.items():
                by[k] = by.get(k, 0) + n
        if by:
            out.append("  requests by version: " + ", ".join(f"{k} {n}" for k, n in sorted(by.items())))
    return out


async def cmd_dump(a) -> int:
    import torch

    from reshard.common.layout.core import dtype_of
    from reshard.proto import reshard_pb2 as pb
    from reshard.proto import reshard_pb2_grpc as rgrpc

    buf, first = bytearray(), None
    async with channel(a.inference) as ch:
        stub = rgrpc.InferenceServiceStub(ch)
        try:
            async for chunk in stub.Dump(pb.DumpRequest(tensor=a.tensor, rank=a.rank), timeout=a.timeout):
                first = first or chunk
                buf.extend(chunk.data)
        except grpc.aio.AioRpcError as e:
            print(f"dump failed: {status_error(e)}", file=sys.stderr)
            return 2
    if first is None or len(buf) != first.total_bytes:
        print("dump failed: incomplete stream", file=sys.stderr)
        return 2
    t = torch.frombuffer(bytes(buf), dtype=dtype_of(first.dtype)).view(tuple(first.shape)).clone()
    torch.save({"name": first.name, "tensor": t, "version": message_to_dict(first.version)}, a.out)
    print(f"{first.name} {list(first.shape)} {first.dtype} version {first.version.run}:{first.version.step} -> {a.out}", file=sys.stderr)
    return 0


def _env_number(name: str, kind, low: float, what: str) -> None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not {what}") from None
    if value < low:
        raise ValueError(f"environment variable {name}={raw!r} must be at least {low} ({what})")


def check_environment() -> None:
    """Every RESHARD_* variable a service or its workers read, checked before anything starts: a bad
    value is refused here, naming it, instead of failing every update later (or a worker at import)."""
    _env_number("RESHARD_ORPHAN_GRACE_S", float, 0, "seconds")
    _env_number("RESHARD_STAGING_LIMIT_BYTES", int, 1 << 20, "a byte count")
    for name in ("RESHARD_FAULT_SLOW_AFTER", "RESHARD_FAULT_SLOW_SECONDS", "RESHARD_FAULT_COMMIT_SECONDS"):
        _env_number(name, float, -1, "a number")
    _env_number("RESHARD_FAULT_RANK", int, 0, "a worker rank")
    level = os.environ.get("RESHARD_LOG_LEVEL", "")
    if level and not isinstance(logging.getLevelName(level.upper()), int):
        raise ValueError(f"environment variable RESHARD_LOG_LEVEL={level!r} is not a log level "
                         "(DEBUG, INFO, WARNING, ERROR)")
    from reshard.common.control import faults  # parses RESHARD_FAULT_AT as it loads

    if faults.SPEC_ERROR:
        raise ValueError(f"environment variable RESHARD_FAULT_AT: {faults.SPEC_ERROR}")


def _log_level(s: str) -> str:
    if not isinstance(logging.getLevelName(s.upper()), int):
        raise argparse.ArgumentTypeError(f"{s!r} (--log-level, or RESHARD_LOG_LEVEL) is not a log level "
                                         "(DEBUG, INFO, WARNING, ERROR)")
    return s


def check_service_args(a) -> None:
    """What argparse alone cannot check in `reshard inference|trainer`; fills in --workers.
    Raises ValueError saying what to change."""
    from reshard.common.models.frameworks import world_of

    if a.command == "inference" and a.deprecated_mode is not None:
        if a.staging not in (None, a.deprecated_mode):
            raise ValueError(f"--staging {a.staging} and --mode {a.deprecated_mode} (its deprecated name) disagree: "
                             "give --staging only")
        log.warning("--mode is deprecated: use --staging %s", a.deprecated_mode)
        a.staging = a.deprecated_mode
    if a.external_workers:
        if a.command == "inference" and a.staging is not None:
            log.warning("--staging %s is ignored with --external-workers: each embedded worker stages as it was made "
                        "(the controller logs what they report)", a.staging)
        a.model = a.model or ""  # a label only: the workers declare their own layout
    else:
        a.model = a.model or DEFAULT_MODEL
    if a.command == "inference":
        a.staging = a.staging or "shadow"
    if not a.external_workers and a.model not in MODELS:
        raise ValueError(f"--model {a.model!r} is not a built-in model: standalone workers take one of "
                         f"{', '.join(sorted(MODELS))} (with --external-workers any label will do)")
    if a.command == "trainer":
        from reshard.common.control.methods import transfer_methods

        if a.transfer_method not in transfer_methods():
            raise ValueError(f"--transfer-method {a.transfer_method!r} is not installed: {', '.join(transfer_methods())}")
    if a.command == "trainer" and a.bucket_bytes:
        from reshard.common.dataplane.backend import plan_options

        try:
            plan_options(a.bucket_bytes, "gloo")
        except ValueError as e:
            raise ValueError(f"--bucket-bytes {a.bucket_bytes}: {e} (0: the default, 16 MiB)") from None
    check_environment()
    layout_world = world_of(a.layout) if a.layout else None
    if a.workers is None:
        a.workers = layout_world or (4 if a.command == "inference" else 2)
    if a.workers < 1:
        raise ValueError("--workers must be at least 1")
    if layout_world is not None and layout_world != a.workers:
        raise ValueError(f"--layout {a.layout} has {layout_world} ranks but --workers is {a.workers}")
    if a.device != "cpu" and not a.external_workers:
        from reshard.common.dataplane.backend import worker_device

        try:
            worker_device(a.device, 0)  # the standalone workers run on this host
        except ValueError as e:
            raise ValueError(f"--device: {e}") from None


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from reshard.common.control.logs import configure

    os.environ["RESHARD_LOG_FORMAT"] = a.log_format  # the standalone workers this process starts log alike
    configure(a.log_level, a.log_format, role=a.command)
    if hasattr(a, "token_file"):
        try:
            sec = apply_flags(a)  # credentials from flags and the environment, checked before anything starts
            if a.command in ("inference", "trainer"):
                sec.check_listen(parse_address(a.listen)[0], f"reshard {a.command}", warn=False)  # the server warns
                if a.metrics_listen:
                    try:
                        sec.check_listen(parse_address(a.metrics_listen)[0], f"reshard {a.command} --metrics-listen", warn=False)
                    except SecurityError as e:
                        raise SecurityError(f"--metrics-listen {a.metrics_listen}: {e}") from None
                if a.worker_listen and not a.worker_listen.startswith("unix:"):
                    sec.for_workers([]).check_listen(parse_address(a.worker_listen)[0], f"reshard {a.command} --worker-listen",
                                                     warn=False)
        except SecurityError as e:
            print(f"reshard {a.command}: {e}", file=sys.stderr)
            return 2
    if a.command in ("inference", "trainer"):
        from reshard.common.control.tracing import configure_from_env

        configure_from_env(a.command)  # traces when the OTEL_ environment asks for them
        try:
            check_service_args(a)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        dl = Deadlines(rpc_s=a.rpc_timeout, update_s=a.update_timeout, worker_s=a.worker_timeout)
        if a.command == "inference":
            from reshard.inference_svc.service import main as inf_main

            return inf_main(a.listen, a.workers, a.model, a.seed, a.staging, dl, spawn_workers=not a.external_workers,
                            layout=a.layout, device=a.device, worker_listen=a.worker_listen or "", pool_bytes=a.pool_bytes,
                            metrics_listen=a.metrics_listen or "")
        from reshard.trainer_svc.service import main as tr_main

        return tr_main(a.listen, a.workers, a.model, a.inference, a.seed, a.run, dl, a.bucket_bytes, a.layout_fault,
                       spawn_workers=not a.external_workers, store_host=a.store_host, layout=a.layout,
                       master_dtype=a.master_dtype, backend=a.backend, device=a.device, allow_rollback=a.allow_rollback,
                       worker_listen=a.worker_listen or "", method=a.transfer_method, metrics_listen=a.metrics_listen or "")
    if a.command == "doctor":
        from reshard.doctor import main as doctor_main

        return doctor_main(a.json)
    if a.command == "plan":
        from reshard.plan_cmd import main as plan_main

        return plan_main(a)
    if a.command == "demo":
        from reshard.demo import run_demo

        return run_demo(a)
    if a.command in ("bench", "simulate", "chaos", "certs", "control-scale"):
        return a._main(a)
    from reshard.common.control.rpc import new_event_loop

    fn = {"update": cmd_update, "status": cmd_status, "dump": cmd_dump, "attach": cmd_attach, "detach": cmd_attach}[a.command]
    loop = new_event_loop()
    try:
        return loop.run_until_complete(fn(a))
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
