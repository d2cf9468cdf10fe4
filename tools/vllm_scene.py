"""`reshard demo --engine vllm`: an FSDP2 trainer (2 ranks, gloo) trains a Llama of about 0.5 GB
of float32 and pushes every step through the reshard services into real vLLM (CPU, TP 2); then,
in the same run and on the same weights, the path RL frameworks use today (full tensors gathered
on trainer rank 0, broadcast to every vLLM worker, sliced by `load_weights`; see
`reshard.tools.vllm_gather_load`). Each update is timed from the moment the trainer starts
sending until vLLM serves the new weights; after each, vLLM's greedy tokens are compared with
those of a Hugging Face model holding the trainer's full weights."""

from __future__ import annotations

import json
import threading
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from reshard.common.control.supervisor import stop_processes

BACKEND = "reshard-gather-load"
BUCKET_BYTES = 256 << 20
PROMPTS = [[1, 17, 33, 250, 999, 4], [1, 500, 2, 3, 77, 12, 900]]
GEN_TOKENS = 8
MODELS = {
    # about 0.5 GB of float32 (124 M parameters): KV heads 4 under TP 2, an untied lm_head
    "llama-0.5g": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000},
    "llama-tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1000},
}


def config(name: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, **MODELS[name]}


def buckets(shapes: list[list[int]], itemsize: int, bucket_bytes: int) -> list[tuple[list[int], int]]:
    """Tensors packed in order into buckets of about `bucket_bytes`: (members, bytes) each.
    Sender and receivers compute the same packing."""
    out: list[tuple[list[int], int]] = []
    members, size = [], 0
    for k, shape in enumerate(shapes):
        n = itemsize
        for d in shape:
            n *= d
        if members and size + n > bucket_bytes:
            out.append((members, size))
            members, size = [], 0
        members.append(k)
        size += n
    if members:
        out.append((members, size))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather_broadcast(model, rank: int, store: str, tp: int, groups: dict) -> None:
    """The baseline's trainer side, on every FSDP2 rank: each full tensor gathered (a collective),
    rank 0 packs them in buckets and broadcasts them to the `tp` vLLM workers (two in flight), over
    a gloo group rendezvoused at `store` (made once, kept in `groups`)."""
    import datetime

    import torch
    import torch.distributed as dist

    if rank == 0 and store not in groups:
        host, p = store.rsplit(":", 1)
        s = dist.TCPStore(host, int(p), is_master=True, timeout=datetime.timedelta(seconds=120))
        groups[store] = dist.ProcessGroupGloo(dist.PrefixStore("gather-load", s), 0, 1 + tp, datetime.timedelta(seconds=600))
    params = list(model.named_parameters())
    plan = buckets([list(p.shape) for _, p in params], 4, BUCKET_BYTES)
    inflight = []
    for members, size in plan:
        flat = torch.empty(size, dtype=torch.uint8) if rank == 0 else None
        at = 0
        for k in members:
            full = params[k][1].full_tensor()  # a collective: every rank takes part
            if rank == 0:
                n = full.numel() * full.element_size()
                flat[at:at + n].copy_(full.reshape(-1).view(torch.uint8))
                at += n
        if rank == 0:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            inflight.append(groups[store].broadcast([flat], opts))
            if len(inflight) > 1:  # two buckets in flight, as vLLM's packed broadcast keeps
                inflight.pop(0).wait()
    for w in inflight:
        w.wait()


def trainer(rank: int, world: int, port: int, workers: str, model_dir: str, cmds, replies) -> None:
    """One FSDP2 rank, driven by the demo: train, publish (reshard), gather-load (the baseline),
    reference (greedy tokens of a plain HF model holding the full weights, on rank 0)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.integrations.dtensor import full_state
    from reshard.trainer_svc.worker import TrainerWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worker = TrainerWorker.from_module(workers, model, run="demo").start()
    gen = torch.Generator().manual_seed(1)
    ref = None
    groups: dict[str, dist.ProcessGroup] = {}
    while True:
        cmd, arg = cmds.get()
        if cmd == "stop":
            break
        if cmd == "train":
            batch = torch.randint(0, cfg.vocab_size, (2, 32), generator=gen)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            replies.put((rank, loss.item()))
        elif cmd == "publish":
            ok = worker.publish(arg).wait(600)
            replies.put((rank, ok))
        elif cmd == "gather_load":  # every rank gathers; rank 0 packs and broadcasts to the vLLM workers
            store, tp = arg
            gather_broadcast(model, rank, store, tp, groups)
            replies.put((rank, True))
        elif cmd == "reference":
            full = full_state(model)
            if rank == 0:
                if ref is None:
                    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
                ref.load_state_dict(full, strict=False)
                out = []
                with torch.no_grad():
                    for p in PROMPTS:
                        ids = list(p)
                        for _ in range(GEN_TOKENS):
                            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
                        out.append(ids[len(p):])
                replies.put((rank, out))
            else:
                replies.put((rank, None))
    worker.stop()
    dist.destroy_process_group()


class Trainers:
    def __init__(self, world: int, workers: str, model_dir: str) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.cmds = [ctx.Queue() for _ in range(world)]
        self.replies = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=trainer, args=(r, world, port, workers, model_dir, self.cmds[r], self.replies))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def send(self, cmd: str, arg=None) -> None:
        for q in self.cmds:
            q.put((cmd, arg))

    def collect(self, timeout: float = 900) -> dict:
        out, deadline = {}, time.monotonic() + timeout
        while len(out) < len(self.procs):
            try:
                r, v = self.replies.get(timeout=5)
                out[r] = v
            except queue.Empty:
                dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"trainer ranks {dead or 'all'} " + ("died" if dead else "timed out")) from None
        return out

    def close(self) -> None:
        self.send("stop")
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


class ResidentMemory:
    """The resident memory of vLLM's processes, sampled on a thread: the steady state before the
    backend is initialized, and the peak after. vLLM's processes are the children of this process
    alive when it is made (vLLM's engine and workers), less the controllers and the trainers; the
    `reshard status` commands run later (children too) are not vLLM's and are not counted."""

    def __init__(self, exclude: set[int]) -> None:
        import psutil

        self.me = psutil.Process()
        self.procs = [p for p in self.me.children(recursive=True) if p.pid not in exclude]
        self.peak, self._stop = 0, threading.Event()
        self._thread: threading.Thread | None = None

    def now(self) -> int:
        import psutil

        total = 0
        for p in self.procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def start(self) -> None:
        def sample() -> None:
            while not self._stop.wait(0.05):
                self.peak = max(self.peak, self.now())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread:
            self._thread.join()
        return max(self.peak, self.now())


def _status(addr: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "reshard.cli", "status", "--trainer", addr, "--json"], capture_output=True,
                       text=True, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def run(a) -> int:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # this is the demo's own process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the results (--json)
    log = sys.stderr
    import torch  # noqa: F401  (before vLLM, which spawns workers)
    from vllm import LLM, SamplingParams

    from reshard.integrations.vllm import update

    name = a.vllm_model
    cfg = config(name)
    tmp = tempfile.mkdtemp(prefix="reshard-demo-vllm-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    tp = world = 2
    inf, tr = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    inf_w, tr_w = f"unix:{tmp}/inference-workers.sock", f"unix:{tmp}/trainer-workers.sock"
    clog = open(os.path.join(tmp, "controllers.log"), "w")
    cli = [sys.executable, "-m", "reshard.cli"]
    procs = [subprocess.Popen([*cli, "inference", "--listen", inf, "--external-workers", "--workers", str(tp), "--worker-listen",
                               inf_w, "--model", name, "--update-timeout", "600"], stdout=clog, stderr=clog),
             subprocess.Popen([*cli, "trainer", "--listen", tr, "--external-workers", "--workers", str(world), "--worker-listen",
                               tr_w, "--inference", inf, "--run", "demo", "--model", name, "--update-timeout", "600"],
                              stdout=clog, stderr=clog)]
    trainers = Trainers(world, tr_w, tmp)
    staging = getattr(a, "staging", "bounded")
    staging_device = (getattr(a, "staging_device", "") or "host") if staging == "staged" else ""
    pooled = staging == "bounded" or staging_device == "host"  # received through a pool on the device
    pool_bytes = getattr(a, "pool_bytes", 128 << 20) if pooled else 0
    results: dict = {"model": name, "engine": "vllm", "trainer": f"FSDP2 x{world}", "inference": f"vLLM TP={tp}",
                     "transport": "gloo", "staging": staging, "staging_device": staging_device, "pool_bytes": pool_bytes,
                     "updates": [], "baseline": []}
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32)
        names = [n for n, _ in meta.named_parameters()]
        shapes = [list(p.shape) for _, p in meta.named_parameters()]
        results["payload_bytes"] = payload = sum(p.numel() * 4 for _, p in meta.named_parameters())
        print(f"reshard demo --engine vllm: {name} ({payload / 1e9:.2f} GB of float32), FSDP2 x{world} -> vLLM TP={tp} "
              "(CPU), gloo on 127.0.0.1; starting vLLM ...", file=log, flush=True)
        t0 = time.perf_counter()
        llm = LLM(model=tmp, tensor_parallel_size=tp, dtype="float32", load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=256, max_num_seqs=4, seed=0, enforce_eager=True, weight_transfer_config={"backend": BACKEND})
        greedy = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)

        def tokens() -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        # Extra memory, measured: vLLM's processes' resident memory over their steady state (serving,
        # before the backend holds anything: after a first generation, so that what serving itself
        # touches, its KV cache pages among it, is not counted as the backend's), at its peak through
        # init and every update.
        mem = ResidentMemory({p.pid for p in procs} | {p.pid for p in trainers.procs})
        tokens()
        time.sleep(1.0)
        steady = mem.now()
        mem.start()
        llm.init_weight_transfer_engine({"init_info": {"controller": inf_w, "timeout": 600, "staging": staging,
                                                       **({"staging_device": staging_device} if staging_device else {}),
                                                       **({"pool_bytes": pool_bytes} if pool_bytes else {})}})
        results["engine_start_seconds"] = time.perf_counter() - t0
        results["weights_bytes_per_rank"] = payload // tp

        def reference() -> list[list[int]]:
            trainers.send("reference")
            return trainers.collect()[0]

        for i in range(1, a.updates + 1):
            trainers.send("train")
            trainers.collect()
            t1 = time.perf_counter()
            trainers.send("publish", i)
            if staging == "bounded":  # the transfer runs inside update_weights: generation waits for all of it
                t_stall = time.perf_counter()
                version = update(llm, i, timeout=600)
                stall = time.perf_counter() - t_stall
                seconds = time.perf_counter() - t1
                trainers.collect()
            else:  # the transfer runs while vLLM serves; generation waits only for the load
                trainers.collect()  # publish(i).wait(): committed on the deployment
                t_stall = time.perf_counter()
                version = update(llm, i, timeout=600)
                stall = time.perf_counter() - t_stall
                seconds = time.perf_counter() - t1
            want = reference()
            hist = next((h for h in reversed(_status(tr).get("history", [])) if int(h["version"]["step"]) == i), {})
            row = {"version": f"demo:{i}", "served": version, "seconds": seconds, "stall_s": stall,
                   "bytes": int(hist.get("bytes", 0)),
                   "verified": bool(hist.get("verified", False)), "tokens_match": tokens() == want, "cold": i == 1,
                   "service_seconds": float(hist.get("seconds", 0.0)),  # publish to commit, as the controller saw it
                   "phases": {k: round(float(v), 4) for k, v in hist.get("phase_seconds", {}).items()}}
            results["updates"].append(row)
            print(f"  reshard      {row['version']:>10s} {seconds:8.3f} s  {row['bytes'] / 1e9:6.3f} GB  verified "
                  f"{'yes' if row['verified'] else 'NO'}  tokens {'match' if row['tokens_match'] else 'DIFFER'}",
                  file=log, flush=True)
        results["extra_bytes_per_rank"] = max(0, mem.stop() - steady) // tp
        results["extra_fraction_of_weights"] = results["extra_bytes_per_rank"] / max(1, results["weights_bytes_per_rank"])
        results["stall_s"] = statistics.median([u["stall_s"] for u in results["updates"] if not u["cold"]]
                                               or [u["stall_s"] for u in results["updates"]])
        print(f"  {staging} staging{f' ({staging_device})' if staging_device else ''}: "
              f"{results['extra_bytes_per_rank'] / 1e6:.1f} MB extra per rank (measured, "
              f"{100 * results['extra_fraction_of_weights']:.0f}% of its {results['weights_bytes_per_rank'] / 1e6:.1f} MB "
              f"of weights); generation paused {results['stall_s']:.3f} s per update", file=log, flush=True)
        want = reference()
        store = f"127.0.0.1:{_free_port()}"
        for j in range(1, a.baseline_updates + 1):
            t1 = time.perf_counter()
            trainers.send("gather_load", (store, tp))
            llm.start_weight_update()
            llm.update_weights({"update_info": {"gather_load": {"store": store, "names": names, "shapes": shapes,
                                                                "dtype": "float32", "bucket_bytes": BUCKET_BYTES,
                                                                "version": a.updates}}})
            llm.finish_weight_update(weight_version=f"gather-load:{j}")
            llm.reset_prefix_cache()
            seconds = time.perf_counter() - t1
            trainers.collect()
            row = {"version": f"gather-load:{j}", "seconds": seconds, "bytes": payload * tp,
                   "tokens_match": tokens() == want, "cold": j == 1}
            results["baseline"].append(row)
            print(f"  gather-load  {row['version']:>10s} {seconds:8.3f} s  {row['bytes'] / 1e9:6.3f} GB  "
                  f"tokens {'match' if row['tokens_match'] else 'DIFFER'}", file=log, flush=True)

        def warm_median(rows: list[dict]) -> float:
            warm = [r["seconds"] for r in rows if not r["cold"]] or [r["seconds"] for r in rows]
            return statistics.median(warm) if warm else 0.0

        results["reshard_seconds"] = ours = warm_median(results["updates"])
        results["baseline_seconds"] = base = warm_median(results["baseline"])
        results["speedup_vs_gather_load"] = base / ours if ours and base else None
        ok = all(u["verified"] and u["tokens_match"] for u in results["updates"]) and \
            all(b["tokens_match"] for b in results["baseline"])
        results["ok"] = ok
        if a.json:
            print(json.dumps(results, indent=2))
        else:
            sp = results["speedup_vs_gather_load"]
            print(f"\nreshard {ours:.3f} s/update vs gather-and-load {base:.3f} s/update: speedup "
                  f"{sp:.2f}x (medians of warm updates)" if sp else "\n(no baseline run)")
            print(f"tokens match the trainer's weights on every update: {'yes' if ok else 'NO'}")
        llm.shutdown_weight_transfer_engine()
        return 0 if ok else 1
    finally:
        trainers.close()
        stop_processes(procs)
