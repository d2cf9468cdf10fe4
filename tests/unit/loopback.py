"""An in-process transport for running every rank's Engine one after another in a test:
senders run first and leave their messages on a shared wire; a receive must match the
sent size exactly (gloo aborts the process on a mismatch, so the tests are stricter)."""

from reshard.common.dataplane.transport import Transport, Work


class Done(Work):
    def wait(self, timeout_s: float) -> None:
        return None


class Loopback(Transport):
    name = "loopback"

    def __init__(self, rank: int, wire: dict) -> None:
        self.rank, self.wire = rank, wire

    def send(self, buf, peer, tag):
        self.wire[(self.rank, peer, tag)] = buf.clone()
        return Done()

    def recv(self, buf, peer, tag):
        sent = self.wire.pop((peer, self.rank, tag))
        assert sent.numel() == buf.numel(), f"rank {peer} sent {sent.numel()} bytes (tag {tag}) into a {buf.numel()}-byte receive"
        buf.copy_(sent)
        return Done()

    def close(self) -> None:
        pass
