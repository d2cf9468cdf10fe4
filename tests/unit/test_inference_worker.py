"""What an inference rank serves when it loses its controller (inference_svc/worker.py)."""

import pytest
import torch

from reshard.common.layout.core import Box, LocalBuffer, Piece, TensorSpec
from reshard.inference_svc.worker import InferenceWorker
from reshard.proto import reshard_pb2 as pb


def _worker() -> InferenceWorker:
    spec = TensorSpec("w", (4, 4), "float32")
    desc = LocalBuffer("w", (4, 4), "float32", (Piece("w", Box((0, 0), (4, 4)), Box((0, 0), (4, 4))),))
    w = InferenceWorker("127.0.0.1:1", 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4, 4))},
                        version=pb.Version(run="r", step=3))
    w.held = False  # its controller allowed it to serve step 3
    return w


def test_lost_between_verify_and_commit_the_rank_holds():
    """Its peers may have committed the new version or not: it must not serve beside them."""
    w = _worker()
    w._verifying = "u1"  # what _on_verify records when the controller asks it to verify update u1
    w.on_controller_lost()
    with w.serving() as version:
        assert version is None
    assert w.held


def test_lost_at_any_other_time_the_rank_keeps_serving():
    w = _worker()
    w.on_controller_lost()
    with w.serving() as version:
        assert version == pb.Version(run="r", step=3)


def test_an_abort_from_the_controller_clears_the_verify_mark():
    w = _worker()
    w._verifying = "u1"
    w.on_abort("u1")  # aborted on every rank: nobody commits it
    w.on_controller_lost()
    assert not w.held


def test_a_partial_commit_leaves_the_torn_tensors_unserved():
    """In place, a failed update tears what it carried; a later one that carries only part of it
    makes that part whole and the rank still does not serve (issue 28, item 2)."""
    from reshard.proto import worker_pb2 as wpb

    specs = {n: TensorSpec(n, (2,), "float32") for n in ("a", "b")}
    bufs = {n: (LocalBuffer(n, (2,), "float32", (Piece(n, Box((0,), (2,)), Box((0,), (2,))),)), torch.zeros(2))
            for n in specs}
    w = InferenceWorker("127.0.0.1:1", 0, 1, specs, bufs, staging="inplace", version=pb.Version(run="r", step=1))
    w.held = False
    w.before_transfer(wpb.Prepare(update_id="u1"))  # a full update, in place
    w.on_abort("u1")  # failed midway
    assert w.torn == {"a", "b"}
    w.before_transfer(wpb.Prepare(update_id="u2", tensors=["a"]))
    w._commit(pb.Version(run="r", step=2))
    with w.serving() as version:
        assert version is None and w.torn == {"b"}
    w.before_transfer(wpb.Prepare(update_id="u3"))
    w._commit(pb.Version(run="r", step=3))
    with w.serving() as version:
        assert version.step == 3


def test_the_commit_copy_waits_for_the_engines_queued_work(monkeypatch):
    """On a GPU, the shadow -> live copy is ordered after every stream's queued work (the engine's
    step returns before its kernels end) and finished before the engine resumes (item 3). CUDA's
    calls are recorded here, around the copies (CPU tensors stand in for the device's)."""
    calls: list[str] = []

    class Stream:
        def synchronize(self):
            calls.append("stream_sync")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("device_sync"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    w = _worker()
    w.device = "cuda:0"

    class Recording(torch.Tensor):
        pass

    orig = w.live["w"]
    w.live["w"] = orig.as_subclass(Recording)
    real_copy = torch.Tensor.copy_

    def copy_(self, src, *a, **kw):
        calls.append("copy")
        return real_copy(self, src, *a, **kw)

    monkeypatch.setattr(Recording, "copy_", copy_)
    w._commit(pb.Version(run="r", step=4))
    assert calls == ["device_sync", "copy", "stream_sync"], calls


def test_staging_and_its_deprecated_name_mode(monkeypatch):
    """`staging` says how a worker stages (shadow by default); `mode=`, its earlier name, still works and
    warns once per process (DeprecationWarning); the two disagreeing, or an unknown staging, is refused."""
    import warnings

    import pytest

    from reshard.inference_svc import worker as worker_mod

    spec = TensorSpec("w", (4, 4), "float32")
    desc = LocalBuffer("w", (4, 4), "float32", (Piece("w", Box((0, 0), (4, 4)), Box((0, 0), (4, 4))),))

    def make(**kw) -> InferenceWorker:
        return InferenceWorker("127.0.0.1:1", 0, 1, {"w": spec}, {"w": (desc, torch.zeros(4, 4))}, **kw)

    assert make().staging == "shadow" and make().shadow is not None
    w = make(staging="inplace")
    assert w.staging == "inplace" and w.shadow is None
    monkeypatch.setattr(worker_mod, "_mode_warned", False)
    with pytest.warns(DeprecationWarning, match="`mode` is deprecated: it is `staging` now"):
        w = make(mode="inplace")
    assert w.staging == "inplace" and w.shadow is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: a second use is silent
        assert make(mode="shadow", staging="shadow").staging == "shadow" and w.mode == "inplace"
    with pytest.raises(ValueError, match="disagree"):
        make(staging="shadow", mode="inplace")
    with pytest.raises(ValueError, match="staging must be one of shadow, inplace, bounded, staged, not 'both'"):
        make(staging="both")


def test_a_flip_commit_swaps_the_copies_and_partial_updates_stay_whole(monkeypatch):
    """flip=True: COMMIT swaps the shadow and live copies (no copy of the weights: the live tensor
    is the one the transfer wrote), and a later partial update still commits, for what it does
    not carry, the last committed values, in a buffer that holds a carried and an uncarried
    tensor too. The expected values are kept apart, tensor by tensor."""
    from reshard.proto import worker_pb2 as wpb

    specs = {"a": TensorSpec("a", (3,), "float32"), "b": TensorSpec("b", (2,), "float32"),
             "c": TensorSpec("c", (2,), "float32")}
    bufs = {"A": (LocalBuffer("A", (3,), "float32", (Piece("a", Box((0,), (3,)), Box((0,), (3,))),)), torch.zeros(3)),
            "BC": (LocalBuffer("BC", (4,), "float32", (Piece("b", Box((0,), (2,)), Box((0,), (2,))),
                                                        Piece("c", Box((0,), (2,)), Box((2,), (2,))))), torch.zeros(4))}
    where = {"a": ("A", slice(0, 3)), "b": ("BC", slice(0, 2)), "c": ("BC", slice(2, 4))}

    def run(flip: bool, level: bool = True) -> tuple[list[dict], bool]:
        w = InferenceWorker("127.0.0.1:1", 0, 1, specs, {n: (d, t.clone()) for n, (d, t) in bufs.items()},
                            version=pb.Version(run="r", step=0), flip=flip)
        if not level:
            monkeypatch.setattr(w, "_level_shadow", lambda: None)
        w.held = False
        seen, swapped = [], True
        for step, carried in enumerate([None, ["b"], ["c"], ["a"], None, ["b", "c"]], start=1):
            w.before_transfer(wpb.Prepare(update_id=f"u{step}", tensors=carried or []))
            staged = w.transfer_buffers()
            ptrs = {n: t.data_ptr() for n, t in staged.items()}
            for name in carried or specs:  # the transfer: each carried tensor's piece, nothing else
                buf, sl = where[name]
                staged[buf][sl] = float(step)
            w._commit(pb.Version(run="r", step=step))
            swapped &= all(w.live[where[n][0]].data_ptr() == ptrs[where[n][0]] for n in carried or specs)
            with w.serving() as version:
                assert version.step == step
                seen.append({n: w.live[b][sl].tolist() for n, (b, sl) in where.items()})
        return seen, swapped

    last = {"a": 0.0, "b": 0.0, "c": 0.0}  # what each tensor should hold: the last update that carried it
    expected = []
    for step, carried in enumerate([None, ["b"], ["c"], ["a"], None, ["b", "c"]], start=1):
        last.update({n: float(step) for n in carried or specs})
        expected.append({n: [v] * specs[n].shape[0] for n, v in last.items()})
    flipped, swapped = run(flip=True)
    assert flipped == expected and swapped
    copied, swapped = run(flip=False)
    assert copied == expected and not swapped  # the copying commit keeps the live tensors where they are
    # Negative control: a flip that does not bring the shadow level loses the other tensor of a
    # buffer a partial update writes in part
    broken, _ = run(flip=True, level=False)
    assert broken != expected
    with pytest.raises(ValueError, match="flip swaps the shadow and live copies"):
        InferenceWorker("127.0.0.1:1", 0, 1, specs, {n: (d, t.clone()) for n, (d, t) in bufs.items()},
                        staging="inplace", flip=True)
