"""An RL loop in one file: an FSDP2 trainer (2 ranks, gloo) trains a small Llama and, after
every step, pushes its weights through reshard straight into vLLM (tensor parallel 2), which
then generates with them.

    python examples/vllm_fsdp2.py                 # starts its own reshard controllers
    python examples/vllm_fsdp2.py --json out.json --save-weights DIR
    python examples/vllm_fsdp2.py --server        # a vLLM server (`vllm serve`) instead of an offline LLM
    python examples/vllm_fsdp2.py --server --trainer-api   # the trainer drives vLLM through vLLM's trainer API
    python examples/vllm_fsdp2.py --ray --trainer-api      # vLLM in a Ray actor, driven through vLLM's Ray client
    python examples/vllm_fsdp2.py --model mixtral --expert-parallel   # whole experts per vLLM rank (GPU builds:
                                                  # vLLM's CPU build 0.32 crashes in its fused-MoE kernel under EP)

What the user code does, on each side:
  trainer ranks: worker = TrainerWorker.from_module(WORKERS, model); ...; worker.publish(step).wait()
  vLLM:          LLM(..., weight_transfer_config={"backend": "reshard"})
                 llm.init_weight_transfer_engine({"init_info": {"controller": WORKERS}})
                 reshard.integrations.vllm.update(llm, step)
  or a server:   VLLM_SERVER_DEV_MODE=1 vllm serve ... --weight-transfer-config '{"backend": "reshard"}'
                 POST /init_weight_transfer_engine {"init_info": {"controller": WORKERS}}
                 reshard.integrations.vllm.update_server(URL, step)
  or vLLM's trainer API (--trainer-api): every trainer rank
                 engine = WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(rank=rank,
                     trainer=WORKERS, controller=INFERENCE_WORKERS), client=HTTPVLLMWeightSyncClient(URL),
                     source=DTensorModuleSource(model, world)); ...; engine.send_weights()
                 (with --ray, client=RayVLLMWeightSyncClient(actor) for an LLM in a Ray actor)
The reshard controllers are two services (`reshard trainer`, `reshard inference`); this script
starts them on this host, as a deployment runs them beside the trainer and the server."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

# vLLM's CPU build on a small machine (a GPU deployment sets none of these).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

COMMON = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 64,
          "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    # KV heads replicated under TP 2; a vocabulary padded from 1000 to 1024 rows.
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 1, **COMMON},
    # 4 stacked experts (top 2), split by intermediate rows under TP 2.
    # 4 query heads in 2 groups: Megatron-core needs whole query groups on each TP rank.
    "llama-gqa": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **COMMON, "num_attention_heads": 4,
                  "num_key_value_heads": 2},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_key_value_heads": 2,
                "num_local_experts": 4, "num_experts_per_tok": 2, **COMMON},
}
PROMPTS = [[1, 17, 33, 250, 999, 4], [1, 500, 2, 3], [1] + list(range(100, 140))]


def trainer(rank: int, world: int, port: int, workers: str, model_dir: str, vocab: int, steps: int, save: str, go, done,
            api: tuple[str, str, str] | None = None) -> None:
    """One FSDP2 rank: when told to, a training step, then publish; `steps` times. With `api` (`http`
    and the vLLM server's URL, or `ray` and the Ray cluster's address; the inference controller's
    worker listener), through vLLM's trainer API instead: rank 0 makes vLLM serve each step itself."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.integrations.dtensor import full_state
    from reshard.trainer_svc.worker import TrainerWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if api:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource
        from vllm.plugins import load_general_plugins

        from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo

        load_general_plugins()  # registers reshard's engines (its vllm.general_plugins entry point)
        kind, target, inf_workers = api
        if kind == "http":
            client = HTTPVLLMWeightSyncClient(target)
        elif rank == 0:  # only the sender calls the client (reshard's engine never touches it elsewhere)
            import ray

            ray.init(address=target, namespace=OnRay.NAMESPACE, log_to_driver=False)
            client = RayVLLMWeightSyncClient(ray.get_actor(OnRay.NAME))
        else:
            client = None
        engine = WeightTransferTrainerFactory.trainer_init(
            ReshardTrainerInitInfo(rank=rank, world=world, trainer=workers, controller=inf_workers, run="rl",
                                   engine={"pool_bytes": 1 << 20}),
            client=client, source=DTensorModuleSource(model, world))
    else:
        worker = TrainerWorker.from_module(workers, model, run="rl").start()
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        go.get()  # the driver's turn: rollouts with the previous version are done
        batch = torch.randint(0, vocab, (4, 32), generator=gen)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if api:
            t0 = time.perf_counter()
            engine.send_weights()  # every rank; rank 0 drives the server: it serves the step when this returns
            if rank == 0:
                done.put((step, float(loss), engine.version, time.perf_counter() - t0))
            full = full_state(model)
            if save and rank == 0:
                torch.save(full, os.path.join(save, f"step{step}.pt"))
            continue
        handle = worker.publish(step)
        if rank == 0:  # the driver asks vLLM for the step now: a bounded vLLM takes it inside update_weights
            done.put((step, float(loss)))
        if not handle.wait(300):
            raise RuntimeError(f"trainer rank {rank}: step {step} was not taken within 300 s")
        full = full_state(model)  # a reference for the checks (a collective); not part of an update
        if save and rank == 0:
            torch.save(full, os.path.join(save, f"step{step}.pt"))
    if api:
        engine.shutdown()
    else:
        worker.stop()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_controllers(tmp: str, ranks: int, world: int) -> tuple[list[subprocess.Popen], str, str]:
    """`reshard inference` and `reshard trainer`, both waiting for embedded workers."""
    inf, inf_w, tr_w = f"127.0.0.1:{free_port()}", f"unix:{tmp}/inference-workers.sock", f"unix:{tmp}/trainer-workers.sock"
    cmd = [sys.executable, "-m", "reshard.cli"]
    log = open(os.path.join(tmp, "controllers.log"), "w")
    procs = [subprocess.Popen([*cmd, "inference", "--listen", inf, "--external-workers", "--workers", str(ranks),
                               "--worker-listen", inf_w, "--model", "llama-small"], stdout=log, stderr=log),
             subprocess.Popen([*cmd, "trainer", "--listen", f"127.0.0.1:{free_port()}", "--external-workers",
                               "--workers", str(world), "--worker-listen", tr_w, "--inference", inf, "--run", "rl",
                               "--model", "llama-small"], stdout=log, stderr=log)]
    return procs, inf_w, tr_w


class Offline:
    """vLLM in this process (`vllm.LLM`)."""

    def __init__(self, model_dir: str, tp: int, workers: str, expert_parallel: bool = False, pp: int = 1,
                 staging: str = "", staging_device: str = "", pool_bytes: int = 1 << 20) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32", load_format="dummy", skip_tokenizer_init=True,
                       max_model_len=256, max_num_seqs=8, seed=0, enforce_eager=True,  # eager: a quick start on CPU
                       enable_expert_parallel=expert_parallel, weight_transfer_config={"backend": "reshard"})
        info = {"controller": workers, "staging": staging, "staging_device": staging_device, "pool_bytes": pool_bytes}
        self.llm.init_weight_transfer_engine({"init_info": {k: v for k, v in info.items() if v}})  # unset: the backend's default
        self.greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True, detokenize=False)

    def update(self, step: int) -> str:
        from reshard.integrations.vllm import update

        return update(self.llm, step, run="rl")  # waits until every vLLM rank has it, then serves it

    def generate(self, prompts: list[list[int]]) -> list[dict]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.greedy, use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]} for o in outs]

    def weight_version(self) -> str:
        return self.llm.get_weight_version()

    def close(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


class OnRay:
    """vLLM's `LLM` in a Ray actor (a Ray instance on this host), as RL frameworks run their engines; the
    trainer drives it through vLLM's Ray client."""

    NAME, NAMESPACE = "reshard-example-vllm", "reshard-example"

    def __init__(self, model_dir: str, tp: int) -> None:
        import ray
        from vllm import LLM, SamplingParams

        ray.init(num_cpus=4, include_dashboard=False, namespace=self.NAMESPACE, log_to_driver=False)
        self.address = ray.get_runtime_context().gcs_address
        actor = ray.remote(num_cpus=0)(LLM)
        self.llm = actor.options(name=self.NAME).remote(
            model=model_dir, tensor_parallel_size=tp, dtype="float32", load_format="dummy", skip_tokenizer_init=True,
            max_model_len=256, max_num_seqs=8, seed=0, enforce_eager=True, distributed_executor_backend="mp",
            weight_transfer_config={"backend": "reshard"})
        self.greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True, detokenize=False)
        ray.get(self.llm.get_weight_version.remote())  # started

    def generate(self, prompts: list[list[int]]) -> list[dict]:
        import ray

        outs = ray.get(self.llm.generate.remote([{"prompt_token_ids": p} for p in prompts], self.greedy, use_tqdm=False))
        return [{"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]} for o in outs]

    def weight_version(self) -> str:
        import ray

        return ray.get(self.llm.get_weight_version.remote())

    def close(self) -> None:
        import ray

        try:
            ray.get(self.llm.shutdown_weight_transfer_engine.remote())
        finally:
            ray.kill(self.llm)
            ray.shutdown()


class Server:
    """A vLLM server (`vllm serve`), driven over HTTP."""

    def __init__(self, model_dir: str, tp: int, workers: str, log, init: bool = True) -> None:
        self.url, self.model = f"http://127.0.0.1:{free_port()}", model_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "--model", model_dir, "--tensor-parallel-size", str(tp), "--dtype", "float32", "--load-format", "dummy",
             "--skip-tokenizer-init", "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0", "--enforce-eager",
             "--enable-scale-out",  # the tokens-in, tokens-out route (this model has no tokenizer)
             "--weight-transfer-config", json.dumps({"backend": "reshard"})],
            env=dict(os.environ, VLLM_SERVER_DEV_MODE="1"), stdout=log, stderr=log)  # dev mode: the weight-transfer routes
        deadline = time.monotonic() + 600
        while True:
            try:
                self.call("GET", "/health")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the vLLM server did not start") from None
                time.sleep(1)
        if init:  # else the trainer initializes it (vLLM's trainer API)
            self.call("POST", "/init_weight_transfer_engine", {"init_info": {"controller": workers}})

    def call(self, method: str, path: str, body: dict | None = None):
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url + path, method=method, headers={"Content-Type": "application/json"},
                                     data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                data = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}") from None
        return json.loads(data) if data else None

    def update(self, step: int) -> str:
        from reshard.integrations.vllm import update_server

        return update_server(self.url, step, run="rl")  # the trainer's run= below: vLLM reports rl:STEP

    def generate(self, prompts: list[list[int]]) -> list[dict]:
        out = []
        for p in prompts:
            r = self.call("POST", "/inference/v1/generate", {  # tokens in, tokens out: no tokenizer needed
                "token_ids": p, "sampling_params": {"max_tokens": 8, "temperature": 0.0, "logprobs": 0, "ignore_eos": True,
                                                    "detokenize": False}})
            c = r["choices"][0]
            out.append({"tokens": c["token_ids"], "logprobs": [x["logprob"] for x in c["logprobs"]["content"]]})
        return out

    def weight_version(self) -> str:
        return self.call("GET", "/weight_info")["weight_version"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main(trainer=trainer, default_model: str = "llama", doc: str = __doc__) -> None:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default=default_model)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--server", action="store_true", help="drive a vLLM server over HTTP instead of an offline LLM")
    ap.add_argument("--trainer-api", action="store_true",
                    help="with --server or --ray: the trainer ranks drive vLLM through vLLM's trainer API "
                         "(WeightTransferTrainerFactory.trainer_init, send_weights)")
    ap.add_argument("--ray", action="store_true", help="vLLM's LLM in a Ray actor (with --trainer-api)")
    ap.add_argument("--expert-parallel", action="store_true", help="vLLM places whole experts on ranks (MoE models)")
    ap.add_argument("--tp", type=int, default=2, help="vLLM's tensor parallel size")
    ap.add_argument("--pp", type=int, default=1, help="vLLM's pipeline parallel size (offline only)")
    ap.add_argument("--staging", choices=["bounded", "staged", "shadow"], default="",
                    help="how the vLLM ranks stage updates (offline only; default: the backend's, bounded: through a "
                         "pool of --pool-bytes)")
    ap.add_argument("--staging-device", choices=["host", "device"], default="",
                    help="with --staging staged: where the copy lives (default: the backend's, host)")
    ap.add_argument("--pool-bytes", type=int, default=1 << 20)
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--save-weights", default="", help="save the trainer's full weights after each step here")
    args = ap.parse_args()

    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="reshard-example-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(CONFIGS[args.model], f)
    world, tp = 2, args.tp
    if args.pp > 1 and args.server:
        ap.error("--pp: the example's server mode runs TP only")
    if args.trainer_api and not (args.server or args.ray):
        ap.error("--trainer-api needs --server or --ray (the trainer ranks reach vLLM over HTTP or through Ray)")
    if args.ray and (args.server or not args.trainer_api):
        ap.error("--ray runs vLLM's LLM in a Ray actor driven through vLLM's trainer API: with --trainer-api, without --server")
    procs, inf_workers, tr_workers = start_controllers(tmp, tp * args.pp, world)
    ctx = mp.get_context("spawn")
    go, done = [ctx.Queue() for _ in range(world)], ctx.Queue()
    port = free_port()
    results = {"updates": []}
    engine, trainers = None, []
    try:
        t0 = time.perf_counter()
        api = None
        if args.ray:  # vLLM first: the trainer ranks initialize its engine
            engine = OnRay(tmp, tp)
            api = ("ray", engine.address, inf_workers)
        elif args.trainer_api:
            engine = Server(tmp, tp, inf_workers, sys.stderr, init=False)
            api = ("http", engine.url, inf_workers)
        trainers = [ctx.Process(target=trainer, args=(r, world, port, tr_workers, tmp, COMMON["vocab_size"], args.steps,
                                                      args.save_weights, go[r], done, api)) for r in range(world)]
        for p in trainers:  # they build their model and attach while vLLM starts; they train when told to
            p.start()
        if engine is None:
            engine = Server(tmp, tp, inf_workers, sys.stderr) if args.server else Offline(
                tmp, tp, inf_workers, args.expert_parallel, args.pp, args.staging, args.staging_device, args.pool_bytes)
        results["engine_start_seconds"] = time.perf_counter() - t0
        for _ in range(args.steps):
            for g in go:
                g.put(True)  # train one step and publish it
            if args.trainer_api:  # the trainer made the server serve it
                step, loss, version, seconds = done.get(timeout=600)
            else:
                step, loss = done.get(timeout=600)  # the trainer published it
                t1 = time.perf_counter()
                version = engine.update(step)
                seconds = time.perf_counter() - t1
            gens = engine.generate(PROMPTS)
            results["updates"].append({"step": step, "version": version, "loss": loss, "seconds": seconds,
                                       "weight_version": engine.weight_version(), "generations": gens})
            print(f"step {step}: loss {loss:.4f}, vLLM serves version {version} ({seconds:.3f} s), "
                  f"tokens {gens[0]['tokens']}", flush=True)
        for p in trainers:
            p.join(120)
        results["prompts"], results["config"] = PROMPTS, CONFIGS[args.model]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
    finally:
        for p in trainers:  # first: a trainer waiting for its next step must not outlive a failure below
            if p.is_alive():
                p.kill()
        try:
            if engine is not None:
                engine.close()  # raises if vLLM's engine died: the controllers are stopped all the same
        finally:
            for p in procs:
                p.terminate()
                p.wait(30)


if __name__ == "__main__":
    main()
