"""Helpers for testing sessions whose ranks share GPUs (CUDA IPC, hybrid) on CPU: every rank
runs on a thread of one process, so CUDA's handle export and mapping are replaced by an
in-process table (threads share memory as processes on one GPU do through IPC), and every
destination piece is checked against values computed apart from the plan (`init_box`)."""

from __future__ import annotations

import torch

from reshard.common.layout.core import dtype_of
from reshard.tools.synth import init_box


def in_process_ipc(monkeypatch, module) -> dict:
    """Replace `module`'s export_buffers/import_buffers: a handle is a key into the returned table."""
    table: dict[bytes, dict] = {}

    def export(bufs: dict) -> bytes:
        key = str(id(bufs)).encode()
        table[key] = bufs
        return key

    monkeypatch.setattr(module, "export_buffers", export)
    monkeypatch.setattr(module, "import_buffers", lambda data, device=None: dict(table[data]))
    return table


def buffers(lay, rank: int, shapes, seed: int | None) -> dict[str, torch.Tensor]:
    """A rank's buffers: every piece holds its canonical values (`seed`), or zeros (None)."""
    out = {b.name: torch.zeros(b.shape, dtype=dtype_of(b.dtype)) for b in lay.ranks[rank]}
    for b in lay.ranks[rank] if seed is not None else ():
        for p in b.pieces:
            init_box(p.view(out[b.name]), seed, p.tensor, p.box.offset, shapes[p.tensor])
    return out


def assert_canonical(lay, rank: int, bufs: dict[str, torch.Tensor], shapes, seed: int) -> None:
    for b in lay.ranks[rank]:
        for p in b.pieces:
            want = torch.empty(p.box.size, dtype=dtype_of(b.dtype))
            init_box(want, seed, p.tensor, p.box.offset, shapes[p.tensor])
            assert torch.equal(p.view(bufs[b.name]), want), (rank, b.name, p.tensor)
