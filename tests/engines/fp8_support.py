"""Test support for the vLLM FP8 tests' scripts (this folder is on their PYTHONPATH, in vLLM's
workers too).

`load_canonical`: the backend's load of a rank's buffers filled from canonical tensors.

`update_from_fsdp2_rows`: one real update through the services into a live `vllm.LLM`, from
three trainer workers holding fp32
masters of a checkpoint cut by rows as FSDP2's Shard(0) cuts them (`torch.chunk` of each
parameter: whole experts of stacked experts; 256-row weights 86, 86, 84, so the cuts fall inside
rows of 128 x 128 blocks). The vLLM backend runs with its defaults (bounded staging, block FP8
quantized on the sender)."""

import json
import os
import socket
import subprocess
import sys


def load_canonical(eng, canon: dict, spoil: dict) -> None:
    """Fill every buffer of the backend's layout (`eng.layout`) from the canonical tensors `canon`
    by its pieces, after scaling `spoil`'s boxes (name -> ([[start, stop] per dim], factor)), and
    load them through the backend's own path (vLLM's layerwise reload; staged in host memory)."""
    import torch

    for name, (index, factor) in spoil.items():
        canon[name] = canon[name].clone()
        box = tuple(slice(a, b) for a, b in index)
        canon[name][box] = (canon[name][box].float() * factor).to(canon[name].dtype)
    staged = {}
    for b in eng.layout.buffers:
        staged[b.name] = buf = torch.zeros(b.shape, dtype=getattr(torch, b.dtype))
        for p in b.pieces:
            p.view(buf).copy_(canon[p.tensor][p.box.slices()])
    eng.host = staged
    eng._load(None)


def _port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def update_from_fsdp2_rows(llm, tmp: str, checkpoint: str, model: str, wrong_modules, tokens) -> dict:
    """Start `reshard inference` and `reshard trainer`, attach vLLM's ranks, publish step 1 from the
    trainer workers and have vLLM serve it. Returns what `served`, `after_update`
    (`llm.collective_rpc(wrong_modules)`), `tokens_after_update` and `update_bytes` (the update's
    bytes on the wire, from `reshard status`) say."""
    import torch
    import transformers

    from reshard.common.layout.core import Box, LocalBuffer, Piece
    from reshard.integrations.dtensor import module_layout
    from reshard.integrations.vllm import update
    from reshard.trainer_svc.worker import TrainerWorker

    inf, tr = f"127.0.0.1:{_port()}", f"127.0.0.1:{_port()}"
    inf_w, tr_w = f"unix:{tmp}/inf.sock", f"unix:{tmp}/tr.sock"
    cli = [sys.executable, "-m", "reshard.cli"]
    res = {}
    with open(os.path.join(tmp, "controllers.log"), "w") as log:
        procs = [subprocess.Popen([*cli, "inference", "--listen", inf, "--external-workers", "--workers", "2",
                                   "--worker-listen", inf_w, "--model", model], stdout=log, stderr=log),
                 subprocess.Popen([*cli, "trainer", "--listen", tr, "--external-workers", "--workers", "3",
                                   "--worker-listen", tr_w, "--inference", inf, "--run", "rl", "--model", model],
                                  stdout=log, stderr=log)]
        try:
            masters = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
            _, _, tensors, whole = module_layout(masters, rank=0, world=1)
            trainers = []
            for r in range(3):
                bufs = {}
                for name, (desc, t) in whole.items():
                    (piece,) = desc.pieces
                    chunks = torch.chunk(t, 3)
                    if r < len(chunks):
                        c, at = chunks[r], sum(x.shape[0] for x in chunks[:r])
                        box = Box((at,) + (0,) * (c.dim() - 1), tuple(c.shape))
                        bufs[name] = (LocalBuffer(name, tuple(c.shape), desc.dtype,
                                                  (Piece(piece.tensor, Box.full(tuple(c.shape)), box),)), c)
                trainers.append(TrainerWorker(tr_w, r, 3, tensors, bufs, run="rl").start())
            llm.init_weight_transfer_engine({"init_info": {"controller": inf_w}})
            handles = [t.publish(1) for t in trainers]
            res["served"] = update(llm, 1, run="rl", timeout=300)  # bounded: the transfer runs inside update_weights
            assert all(h.wait(300) for h in handles), "step 1 was not committed"
            res["after_update"] = llm.collective_rpc(wrong_modules)
            res["tokens_after_update"] = tokens()
            st = json.loads(subprocess.run([*cli, "status", "--trainer", tr, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
            res["update_bytes"] = st["history"][-1]["bytes"] if st.get("history") else None
            for t in trainers:
                t.stop()
        finally:
            for pr in procs:
                pr.terminate()
                pr.wait(30)
    return res
