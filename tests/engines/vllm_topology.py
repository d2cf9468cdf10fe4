"""Drives one vLLM topology through reshard, for tests/engines/test_vllm_topologies.py.

The FSDP2 trainer of examples/vllm_fsdp2.py (2 ranks, gloo) publishes a training step; the reshard
controllers plan it; real vLLM ranks (its CPU build) receive it through the `reshard` backend. Then
every vLLM rank checks what it received with `TopologyCheck.reshard_check` (a vLLM worker
extension): vLLM's own loader (`model.load_weights`) is fed the checkpoint Hugging Face writes from
the trainer's weights (`save_pretrained`), into fresh parameters shaped as vLLM records them for
loading, and must produce exactly what reshard staged on this rank, and what this rank's layout says
it holds; a layout shifted by one layer (and, for experts, by one expert) must disagree.

    python vllm_topology.py pp OUT         # offline LLM, pipeline parallel 2 x TP 1 (Llama)
    python vllm_topology.py dp-ep OUT      # a server, --data-parallel-size 2 --enable-expert-parallel (Mixtral)
    python vllm_topology.py dp OUT         # 2 data-parallel replicas by an external launcher, one process each
                                           # (Llama): tokens after each update, for the test to compare with HF
    python vllm_topology.py duplicate OUT  # two single-rank vLLMs claim the one rank of a deployment
    python vllm_topology.py torn OUT       # a bounded update fails midway (a trainer rank killed): vLLM labelled torn

Each writes OUT/result.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")
sys.path.insert(0, EXAMPLES)  # here too in spawned children and vLLM's workers (they import this module)

# vLLM's CPU build on a small machine (as the example sets them).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
EXTENSION = "vllm_topology.TopologyCheck"  # importable in vLLM's workers: PYTHONPATH holds HERE (set below)

# Staged on the device (the backend's default before bounded), for the topologies tested before
# bounded ranks took relays; `dp-bounded` runs the data-parallel replicas bounded.
STAGED = {"staging": "staged", "staging_device": "device"}


class TopologyCheck:
    """A vLLM worker extension (`worker_extension_cls`): its methods run on every vLLM rank."""

    def reshard_pid(self) -> int:
        return os.getpid()

    def reshard_check(self, ckpt: str, canonical: str, out_dir: str) -> dict:
        import glob

        import torch
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        eng = self.weight_transfer_engine
        model = self.model_runner.model
        lay, staged = eng.layout, eng.worker.live
        full = torch.load(canonical)
        nan = float("nan")

        # vLLM's loader, into fresh parameters (NaN) in place of the live ones (which vLLM's CPU
        # build repacks after loading, so they cannot be read back), restored afterwards.
        fresh, saved = {}, []
        for t in lay.targets:
            mod = model.get_submodule(t.module)
            if t.buffer not in fresh:
                info = LAYERWISE_INFO.get(mod)
                meta = info.restore_metadata[0].get(t.param) if info is not None else None
                if meta is not None:  # the shape and attributes (weight_loader, ...) vLLM recorded for loading
                    with info.restore_device:
                        p = restore_layer_refs(materialize_meta_tensor(meta), mod)
                else:  # loaded in place (a bias): like the live one
                    live = mod._parameters[t.param]
                    p = torch.nn.Parameter(torch.empty_like(live.data), requires_grad=False)
                    p.__dict__.update(live.__dict__)
                # vLLM's layerwise reload (the backend loads through it) left its deferring wrapper on the
                # recorded loaders: the loader proper writes into this parameter at once.
                p.weight_loader = _get_original_loader(p)
                p.data.fill_(nan)
                fresh[t.buffer] = p
            saved.append((mod, t.param, mod._parameters[t.param]))
            mod._parameters[t.param] = fresh[t.buffer]
        weights = {}
        for f in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
            weights.update(load_file(f))
        try:
            with torch.no_grad():
                model.load_weights(iter(weights.items()))
        finally:
            for mod, name, p in saved:
                mod._parameters[name] = p

        layers = 1 + max(int(n.split(".")[2]) for n in full if n.startswith("model.layers."))

        def shifted(name: str, by_layer: int) -> str:
            if not by_layer or not name.startswith("model.layers."):
                return name
            parts = name.split(".")
            parts[2] = str((int(parts[2]) + by_layer) % layers)
            return ".".join(parts)

        def want(b, by_layer: int = 0, by_expert: int = 0) -> torch.Tensor:
            """The buffer as the layout says it is made from the trainer's tensors (NaN: padding)."""
            w = torch.full(b.shape, nan, dtype=getattr(torch, b.dtype))
            for p in b.pieces:
                src = full[shifted(p.tensor, by_layer)]
                if by_expert and ".experts." in p.tensor:
                    src = torch.roll(src, -by_expert, dims=0)  # expert e from the trainer's expert e + 1
                v = p.view(w)
                v.copy_(src[p.box.slices()].reshape(v.shape))
            return w

        bufs = {}
        for b in lay.buffers:
            w0 = want(b)
            held = ~torch.isnan(w0)
            got, st = fresh[b.name].data, staged[b.name]
            bufs[b.name] = {
                "loader_wrote_all": not bool(torch.isnan(got[held]).any()),
                "loader_eq_layout": torch.equal(got[held], w0[held]),
                # bounded: no copy here (the pool's space went to the next module); tokens tell
                "staged_eq_loader": None if st.is_meta else torch.equal(st[held].to(got.dtype), got[held]),
                "padding": int((~held).sum()),
                "layer": b.name.startswith("model.layers."),
                "experts": sorted({e for p in b.pieces for e in range(p.box.offset[0], p.box.end[0])})
                if b.name.endswith(("w13_weight", "w2_weight")) else None,
                "shift_layer_eq": torch.equal(got[held], want(b, by_layer=1)[held]),
                "shift_expert_eq": torch.equal(got[held], want(b, by_expert=1)[held]),
            }
        prepared = eng.worker._prepared  # (update id, plan, destination layout) of the last update here
        plan = {}
        if prepared is not None:
            tab = prepared[1].message_table()
            plan = {"total_bytes": int(tab["nbytes"].sum()), "source_bytes": int(tab["nbytes"][~tab["relay"]].sum()),
                    "relay_bytes": int(tab["nbytes"][tab["relay"]].sum()), "relay_messages": int(tab["relay"].sum()),
                    "received_bytes": int(tab["nbytes"][tab["dst"] == eng.rank].sum())}
        pc = self.vllm_config.parallel_config
        out = {"rank": eng.rank, "world": eng.world, "pid": os.getpid(), "loaded": list(eng.loaded or ()),
               "data_parallel_index": pc.data_parallel_index, "pp_rank": pc.rank // pc.tensor_parallel_size,
               "tensors": sorted({p.tensor for b in lay.buffers for p in b.pieces}),
               "held_bytes": sum(p.box.numel * getattr(torch, b.dtype).itemsize for b in lay.buffers for p in b.pieces),
               "buffers": bufs, "plan": plan, "memory": eng.worker.memory_report(),
               "weights_bytes": sum(b.nbytes for b in lay.buffers)}
        with open(os.path.join(out_dir, f"check-rank{eng.rank}.json"), "w") as f:
            json.dump(out, f)
        return out


# -- the driver's side ----------------------------------------------------------------------
def trainer(rank, world, port, workers, model_dir, vocab, steps, save, go, done) -> None:
    """The example's FSDP2 trainer, counting the bytes this rank sends in each update."""
    from reshard.common.control import worker as cw

    measured = cw.WorkerBase._measured_transfer

    def counting(self, p, plan, src, dst):
        out = measured(self, p, plan, src, dst)
        with open(os.path.join(save, f"sent-rank{self.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"update": p.update_id, "bytes": int(out[1])}) + "\n")
        return out

    cw.WorkerBase._measured_transfer = counting
    import vllm_fsdp2

    vllm_fsdp2.trainer(rank, world, port, workers, model_dir, vocab, steps, save, go, done)


class Controllers:
    """`reshard inference` (and `reshard trainer`) for external workers, as the example starts them."""

    def __init__(self, out: str, ranks: int, world: int = 0, bucket_bytes: int = 0) -> None:
        from vllm_fsdp2 import free_port

        self.inf, self.tr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.inf_workers, self.tr_workers = f"unix:{out}/inference-workers.sock", f"unix:{out}/trainer-workers.sock"
        cmd = [sys.executable, "-m", "reshard.cli"]
        log = open(os.path.join(out, "controllers.log"), "w")
        self.procs = [subprocess.Popen([*cmd, "inference", "--listen", self.inf, "--external-workers", "--workers", str(ranks),
                                        "--worker-listen", self.inf_workers], stdout=log, stderr=log)]
        if world:
            self.procs.append(subprocess.Popen(
                [*cmd, "trainer", "--listen", self.tr, "--external-workers", "--workers", str(world), "--worker-listen",
                 self.tr_workers, "--inference", self.inf, "--run", "rl",
                 *(["--bucket-bytes", str(bucket_bytes)] if bucket_bytes else [])], stdout=log, stderr=log))

    def status(self, which: str = "inference") -> dict:
        addr = self.inf if which == "inference" else self.tr
        r = subprocess.run([sys.executable, "-m", "reshard.cli", "status", f"--{which}", addr, "--json"], capture_output=True,
                           text=True, timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-2000:]}

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)


class Trainers:
    """The 2 FSDP2 ranks, each step when told to."""

    def __init__(self, out: str, ctl: Controllers, model_dir: str, steps: int) -> None:
        import torch.multiprocessing as mp
        from vllm_fsdp2 import COMMON, free_port

        ctx = mp.get_context("spawn")
        self.out, self.go, self.done = out, [ctx.Queue() for _ in range(2)], ctx.Queue()
        self.steps, self.stepped = steps, 0
        port = free_port()
        self.procs = [ctx.Process(target=trainer, args=(r, 2, port, ctl.tr_workers, model_dir, COMMON["vocab_size"], steps, out,
                                                          self.go[r], self.done)) for r in range(2)]
        for p in self.procs:
            p.start()

    def step(self) -> int:
        """Train and publish one step; its number (vLLM may ask for it now)."""
        for g in self.go:
            g.put(True)
        step, _ = self.done.get(timeout=300)
        self.stepped = step
        return step

    def weights(self, step: int) -> str:
        """The trainer's full weights of `step` (saved once the update is taken)."""
        path = os.path.join(self.out, f"step{step}.pt")
        deadline = time.monotonic() + 120
        while not os.path.exists(path) or time.time() - os.path.getmtime(path) < 1:  # written whole
            if time.monotonic() > deadline or not all(p.is_alive() or p.exitcode == 0 for p in self.procs):
                raise RuntimeError(f"the trainer did not save step {step}")
            time.sleep(0.2)
        return path

    def sent(self) -> dict:
        """Bytes each trainer rank sent, per update."""
        out = {}
        for r in range(2):
            path = os.path.join(self.out, f"sent-rank{r}.jsonl")
            for line in open(path) if os.path.exists(path) else ():
                d = json.loads(line)
                out.setdefault(d["update"], {})[r] = d["bytes"]
        return out

    def close(self) -> None:
        for p in self.procs:  # a trainer told fewer steps than it was started for waits for the next: ended here
            p.join(30 if self.stepped == self.steps else 0)
            if p.is_alive():
                p.kill()


def write_model(out: str, model: str) -> str:
    from vllm_fsdp2 import CONFIGS

    d = os.path.join(out, "model")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CONFIGS[model], f)
    return d


def checkpoint(model_dir: str, weights: str, out: str) -> str:
    """The checkpoint Hugging Face writes from the trainer's weights (vLLM's loader reads that format)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(torch.load(weights), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    d = os.path.join(out, "ckpt")
    hf.save_pretrained(d)
    return d


ENGINE_ARGS = dict(dtype="float32", load_format="dummy", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8, seed=0,
                   enforce_eager=True, weight_transfer_config={"backend": "reshard"}, worker_extension_cls=EXTENSION)


def run_pp(out: str) -> dict:
    """PP 2 x TP 1: an update commits and loads on both stages (generation cannot run on the CPU build)."""
    from vllm import LLM

    from reshard.integrations.vllm import update

    model_dir = write_model(out, "llama")
    ctl = Controllers(out, ranks=2, world=2)
    tr = Trainers(out, ctl, model_dir, steps=1)
    res = {}
    try:
        t0 = time.perf_counter()
        llm = LLM(model=model_dir, tensor_parallel_size=1, pipeline_parallel_size=2, **ENGINE_ARGS)
        llm.init_weight_transfer_engine({"init_info": {"controller": ctl.inf_workers, **STAGED}})
        res["engine_start_seconds"] = time.perf_counter() - t0
        step = tr.step()
        t1 = time.perf_counter()
        res["version"] = update(llm, step, run="rl")
        res["update_seconds"] = time.perf_counter() - t1
        res["status"] = ctl.status()
        ckpt = checkpoint(model_dir, tr.weights(step), out)
        res["ranks"] = llm.collective_rpc("reshard_check", args=(ckpt, tr.weights(step), out))
        res["sent"] = tr.sent()
        llm.shutdown_weight_transfer_engine()
    finally:
        tr.close()
        ctl.close()
    return res


def run_dp_ep(out: str) -> dict:
    """A server with 2 data-parallel replicas x TP 1, experts by expert parallelism over them."""
    from vllm_fsdp2 import free_port

    model_dir = write_model(out, "mixtral")
    # Small buckets: what both replicas hold (all but the experts: 1.5 MB here, GBs on a real model)
    # is relayed between them only when it exceeds one bucket (PlanOptions.shared_relay_min_bytes).
    ctl = Controllers(out, ranks=2, world=2, bucket_bytes=65536)
    tr = Trainers(out, ctl, model_dir, steps=1)
    url = f"http://127.0.0.1:{free_port()}"
    log = open(os.path.join(out, "vllm.log"), "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
         "--model", model_dir, "--tensor-parallel-size", "1", "--data-parallel-size", "2", "--enable-expert-parallel",
         "--dtype", "float32", "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "256", "--max-num-seqs", "8",
         "--seed", "0", "--enforce-eager", "--worker-extension-cls", EXTENSION,
         "--weight-transfer-config", json.dumps({"backend": "reshard"})],
        env=dict(os.environ, VLLM_SERVER_DEV_MODE="1"), stdout=log, stderr=log)
    res = {}
    try:
        t0 = time.perf_counter()
        while True:
            try:
                post(url, "/health", None, "GET")
                break
            except OSError:
                if server.poll() is not None or time.perf_counter() - t0 > 400:
                    raise RuntimeError("the vLLM server did not start (see vllm.log)") from None
                time.sleep(1)
        post(url, "/init_weight_transfer_engine", {"init_info": {"controller": ctl.inf_workers, **STAGED}})
        res["engine_start_seconds"] = time.perf_counter() - t0
        step = tr.step()
        t1 = time.perf_counter()
        # vLLM's own calls, as update_server makes them less its /pause and /resume: pausing makes a
        # data-parallel MoE server run a dummy forward pass, which vLLM's CPU build cannot (see the test).
        post(url, "/start_weight_update", {})
        post(url, "/update_weights", {"update_info": {"step": step, "run": "rl", "timeout": 120, "exact": True}})
        post(url, "/finish_weight_update", {"weight_version": f"rl:{step}"})
        res["version"] = post(url, "/weight_info", None, "GET")["weight_version"]
        res["update_seconds"] = time.perf_counter() - t1
        res["status"] = ctl.status()
        ckpt = checkpoint(model_dir, tr.weights(step), out)
        post(url, "/collective_rpc", {"method": "reshard_check", "args": [ckpt, tr.weights(step), out]})
        # A data-parallel server answers a collective call with its first replica's results: each rank wrote its own.
        res["ranks"] = [json.load(open(os.path.join(out, f"check-rank{r}.json"))) for r in range(2)]
        res["sent"] = tr.sent()
    finally:
        server.terminate()
        server.wait(60)
        tr.close()
        ctl.close()
    return res


def post(url: str, path: str, body: dict | None, method: str = "POST"):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, method=method, headers={"Content-Type": "application/json"},
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            data = r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
    return json.loads(data) if data else None


def replica(rank: int, world: int, port: int, model_dir: str, controller: str, cmds, results, init: dict) -> None:
    """One vLLM process of a deployment started by an external launcher (torchrun sets these)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from vllm import LLM, SamplingParams
    from vllm_fsdp2 import PROMPTS

    from reshard.integrations.vllm import update

    llm = LLM(model=model_dir, tensor_parallel_size=1, data_parallel_size=world, distributed_executor_backend="external_launcher",
              **ENGINE_ARGS)
    try:
        llm.init_weight_transfer_engine({"init_info": {"controller": controller, "connect_timeout": 20, **init}})
    except Exception as e:  # noqa: BLE001 - the driver reports it
        results.put((rank, "init", f"{type(e).__name__}: {e}"))
        return
    results.put((rank, "init", ""))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True, detokenize=False)
    while True:
        cmd = cmds.get()
        if cmd[0] == "stop":
            break
        if cmd[0] == "update":
            version = update(llm, cmd[1], run="rl")
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
            gens = [{"tokens": list(o.outputs[0].token_ids),
                     "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]} for o in outs]
            results.put((rank, "update", {"version": version, "weight_version": llm.get_weight_version(), "generations": gens}))
        if cmd[0] == "check":
            results.put((rank, "check", llm.collective_rpc("reshard_check", args=cmd[1])[0]))
    llm.shutdown_weight_transfer_engine()


BOUNDED_POOL = 3 << 19  # 1.5 MiB: less than a rank's weights (2.3 MB in float32)


def run_dp(out: str, steps: int = 2, init: dict | None = None) -> dict:
    """2 data-parallel replicas (TP 1), one process each, as an external launcher starts them
    (staged on the device, or as `init` says)."""
    import torch.multiprocessing as mp
    from vllm_fsdp2 import CONFIGS, PROMPTS, free_port

    model_dir = write_model(out, "llama")
    ctl = Controllers(out, ranks=2, world=2)
    tr = Trainers(out, ctl, model_dir, steps=steps)
    ctx = mp.get_context("spawn")
    cmds, results = [ctx.Queue() for _ in range(2)], ctx.Queue()
    port = free_port()
    init = STAGED if init is None else init
    reps = [ctx.Process(target=replica, args=(r, 2, port, model_dir, ctl.inf_workers, cmds[r], results, init))
            for r in range(2)]
    res = {"config": CONFIGS["llama"], "prompts": PROMPTS, "updates": []}

    def gather(kind: str) -> dict:
        got = {}
        while len(got) < 2:
            r, k, v = results.get(timeout=300)
            assert k == kind, (r, k, v)
            got[r] = v
        return got

    try:
        t0 = time.perf_counter()
        for p in reps:
            p.start()
        res["init_errors"] = {r: e for r, e in gather("init").items() if e}
        res["engine_start_seconds"] = time.perf_counter() - t0
        if res["init_errors"]:
            return res
        for _ in range(steps):
            step = tr.step()
            for c in cmds:
                c.put(("update", step))
            got = gather("update")
            tr.weights(step)
            res["updates"].append({"step": step, "replicas": [got[r] for r in range(2)]})
        res["status"] = ctl.status()
        ckpt = checkpoint(model_dir, tr.weights(steps), out)
        for c in cmds:
            c.put(("check", (ckpt, tr.weights(steps), out)))
        got = gather("check")
        res["ranks"] = [got[r] for r in range(2)]
        res["sent"] = tr.sent()
    finally:
        for c in cmds:
            c.put(("stop",))
        for p in reps:
            p.join(60)
            if p.is_alive():
                p.kill()
        tr.close()
        ctl.close()
    return res


def claimant(model_dir: str, controller: str, results, stop) -> None:
    """A single-rank vLLM (TP 1, no data parallelism): rank 0 of 1, its engine in this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(model=model_dir, tensor_parallel_size=1, **ENGINE_ARGS)
    t0 = time.perf_counter()
    try:
        llm.init_weight_transfer_engine({"init_info": {"controller": controller, "connect_timeout": 60, **STAGED}})
        err = ""
    except Exception as e:  # noqa: BLE001 - the driver reports it
        err = f"{type(e).__name__}: {e}"
    pid = llm.collective_rpc("reshard_pid")[0]  # the pid the controller sees (this process)
    results.put((pid, err, time.perf_counter() - t0))
    stop.wait(120)  # the holder holds the rank until the driver has read the controller's status
    if not err:
        llm.shutdown_weight_transfer_engine()


def run_duplicate(out: str) -> dict:
    """Two single-rank vLLMs, each rank 0 of 1, against a one-rank deployment: one holds the rank, the
    other's init_weight_transfer_engine fails naming the holder, and the holder stays attached."""
    import torch.multiprocessing as mp

    model_dir = write_model(out, "llama")
    ctl = Controllers(out, ranks=1)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    stop = ctx.Event()
    procs = [ctx.Process(target=claimant, args=(model_dir, ctl.inf_workers, results, stop)) for _ in range(2)]
    res = {"claimants": []}
    try:
        for p in procs:  # at once: whichever attaches second is refused
            p.start()
        for _ in range(2):
            pid, err, seconds = results.get(timeout=300)
            res["claimants"].append({"pid": pid, "error": err, "init_seconds": seconds})
        res["status"] = ctl.status()
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        ctl.close()
    return res


def run_torn(out: str) -> dict:
    """Offline LLM, TP 2, bounded staging through a 1 MiB pool. Step 1 commits; in step 2 trainer rank 1
    is killed after its first round of bytes, once modules have been loaded into vLLM's model."""
    from vllm import LLM, SamplingParams

    from reshard.integrations.vllm import update

    model_dir = write_model(out, "llama")
    ctl = Controllers(out, ranks=2, world=2)
    control = os.path.join(out, "fault")
    os.environ["RESHARD_FAULT_AT"] = f"@{control}"  # read by the trainer ranks (spawned next) at each hook
    tr = Trainers(out, ctl, model_dir, steps=2)
    res = {}
    try:
        llm = LLM(model=model_dir, tensor_parallel_size=2, **ENGINE_ARGS)
        llm.init_weight_transfer_engine({"init_info": {"controller": ctl.inf_workers, "pool_bytes": 1 << 20}})
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
        res["first"] = update(llm, tr.step(), run="rl")
        with open(control + ".tmp", "w") as f:
            f.write("trainer-worker:TRANSFER:kill:1")
        os.replace(control + ".tmp", control)
        step = tr.step()
        try:
            update(llm, step, run="rl")
            res["error"] = ""
        except Exception as e:  # noqa: BLE001 - what the caller is told
            res["error"] = str(e)
        res["fired"] = os.path.exists(control + ".fired")
        res["weight_version"] = llm.get_weight_version()
        outs = llm.generate([{"prompt_token_ids": [1, 5, 9]}], greedy, use_tqdm=False)
        res["output_versions"] = [s.version for s in (outs[0].outputs[0].weight_versions or [])]
        res["status"] = ctl.status()
    finally:
        tr.close()
        ctl.close()
    return res


if __name__ == "__main__":
    mode, out = sys.argv[1], os.path.abspath(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, EXAMPLES, *filter(None, [os.environ.get("PYTHONPATH")])])
    result = {"pp": run_pp, "dp-ep": run_dp_ep, "dp": run_dp, "duplicate": run_duplicate, "torn": run_torn,
              "dp-bounded": lambda o: run_dp(o, init={"staging": "bounded", "pool_bytes": BOUNDED_POOL})}[mode](out)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
