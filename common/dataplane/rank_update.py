"""One rank's share of an update, as a worker hands it to its session's transport.

`Transport.run_update(RankUpdate)` is the one call through which a worker moves bytes, whatever
its session's backend: the message-passing transports (gloo, NCCL) run the plan's rounds through
the engine (`RankUpdate.engine`, in the base class), and the CUDA IPC and hybrid transports
override it. The worker never asks which transport it holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from reshard.common.dataplane.engine import Engine, StagingPool
from reshard.common.dataplane.transport import Transport
from reshard.common.layout.core import Layout
from reshard.common.plan.planner import Plan


def _nothing() -> None:
    pass


@dataclasses.dataclass(frozen=True)
class RankUpdate:
    """What `Transport.run_update` moves, and what it reports to as it goes."""

    update_id: str
    plan: Plan
    side: str  # src (a trainer rank) | dst (an inference rank)
    rank: int  # this rank on its side (the session rank of a destination is src_world + rank)
    buffers: dict[str, torch.Tensor]  # what a source sends from, or a destination receives into
    shapes: dict[str, tuple[int, ...]]  # canonical tensor -> its shape (checksums cover boxes of it)
    dst: Layout  # the destination layout: where a destination rank sums what landed
    pool: StagingPool  # the rank's staging, reused across updates
    deadline: float  # time.monotonic() by which this rank's share must be done
    connected: Callable[[], None] = _nothing  # called once the session reaches every peer this rank needs
    progress: Callable[[int, int], None] | None = None  # (bytes done, bytes total) of this rank's share
    hook: Callable[[int], None] | None = None  # after each round of bytes (fault injection, aborts)
    sums_as_landed: bool = True  # a destination sums what lands as it lands (bounded staging sums per buffer itself)
    # Run with the transport and the deadline once the session is connected, before the first byte
    # (trainer ranks sharing rows of FP8 blocks exchange their partial maxima: common/quant.py)
    prelude: Callable[[Transport, float], None] | None = None

    def engine(self, transport: Transport, **extra) -> Engine:
        """The engine that runs this rank's share over `transport` by messages (`extra`: a hybrid
        host's `guests`): a source sums what it sends, a destination what lands."""
        return Engine(transport, self.plan, self.side, self.rank, self.buffers, self.shapes, self.pool, self.deadline,
                      progress=self.progress, checksums=self.side == "src", hook=self.hook,
                      receiver_sums=self.side == "dst" and self.sums_as_landed, **extra)
