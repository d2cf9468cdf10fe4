"""What an inference rank serves when it loses its controller (inference_svc/worker.py)."""

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
