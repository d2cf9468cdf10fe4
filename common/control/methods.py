"""Transfer methods: how an update's bytes move. The core has one, the parallel reshard; tools plug
others in through the `reshard.transfer_methods` entry point (the serialized baseline that
`reshard demo` measures against is one), chosen when a trainer controller starts
(`reshard trainer --transfer-method NAME`), never per request. No torch here: the controller
names methods without importing the data plane."""

from __future__ import annotations

import functools

from reshard.common.layout.core import LayoutError

RESHARD = "reshard"  # the parallel reshard: the one transfer method of the core
METHODS_GROUP = "reshard.transfer_methods"


def transfer_methods() -> list[str]:
    """Every transfer method: the parallel reshard, and those tools plug in through the
    `reshard.transfer_methods` entry point."""
    from importlib.metadata import entry_points

    return [RESHARD, *sorted(ep.name for ep in entry_points(group=METHODS_GROUP) if ep.name != RESHARD)]


@functools.cache
def transfer_method(name: str):
    """A plugged-in method's `run(side, transport, session, rank, src, dst, buffers, shapes, pool,
    deadline, progress, timeout)`, which moves whole tensors and returns (sums, bytes, checksum s).
    Looked up once per process (installed entry points do not change while it runs)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=METHODS_GROUP):
        if ep.name == name:
            return ep.load()
    raise LayoutError(f"unknown transfer method {name!r} (installed: {', '.join(transfer_methods())})")
