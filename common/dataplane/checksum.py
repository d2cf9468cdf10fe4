"""Position-aware checksum of tensor boxes, combinable across pieces, mod 2**32.

A tensor of `shape` is seen as rows (every leading dim flattened: global row index R)
of bytes (the last dim times the element size, in memory order: global byte column g).
Bytes are grouped into 32-bit little-endian words at their *global* positions (word
j = g // 4, lane g % 4), and

    checksum = sum_{R, g} byte[R, g] * 2**(8 * (g % 4)) * wc[g // 4] * wr[R]   mod 2**32

with odd hashed weights wc (of the global word) and wr (of the global row), both below
2**31. Over whole words the inner sum is each word times its weight: one unsigned
32-bit matrix-vector product over the data, read once (numpy; its integer arithmetic
wraps mod 2**32 by definition), with the partial words at a box's two edges done byte
by byte. Checksums of disjoint boxes add up (mod 2**32) to the checksum of their union,
so a sender can checksum the segments it sends and a receiver the piece it holds, and
they agree when every byte arrived at its position. Odd weights make any change of a
single word visible; swapped rows, swapped words and misplaced interleaves change it.

`box_checksum_torch` computes the same number with torch integer ops on the tensor's
own device (no copy to the host), each product reduced before it could overflow;
`box_checksum_tensor` leaves it there, queued on the current stream: its weights are made
on the device too, so nothing in it makes the host wait for the stream."""

from __future__ import annotations

import functools

import numpy as np
import torch

from reshard.common.dataplane.mixing import flat_indices, mix31

P = 1 << 32  # the modulus: checksums are uint32 values
_MASK = P - 1
_COL_SALT, _ROW_SALT = 0x1B873593, 0x2545F491


@functools.lru_cache(maxsize=256)
def _col_weights(j0: int, n: int) -> np.ndarray:
    """Weights of global words j0 .. j0 + n - 1 (odd, below 2**31), as uint32."""
    idx = torch.arange(j0, j0 + n, dtype=torch.int64)
    w = (mix31(idx + _COL_SALT) | 1).numpy().astype(np.uint32)
    w.flags.writeable = False
    return w


def _col_weight(j: int) -> int:
    return int(_col_weights(j, 1)[0])


def _row_weights(offset: tuple[int, ...], lead_size: tuple[int, ...], lead_shape: tuple[int, ...],
                 device: torch.device | None = None) -> torch.Tensor:
    """Weights of the box's global rows, in row-major order (int64, odd, below 2**31)."""
    return mix31(flat_indices(offset, lead_size, lead_shape, device).reshape(-1) + _ROW_SALT) | 1


def _as_rows(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...], device: torch.device | None = None):
    """(rows of bytes (R, ncols * esize), first byte column, row weights) of a box."""
    if values.dim() == 0:
        values, offset, shape = values.reshape(1), (0,), (1,)
    if values.dim() == 1:
        values, offset, shape = values.unsqueeze(0), (0, *offset), (1, *shape)
    lead_size = tuple(values.shape[:-1])
    ncols = values.shape[-1]
    rows = values.reshape(-1, ncols)  # a copy only when the box is strided in leading dims
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    wr = _row_weights(offset[:-1], lead_size, shape[:-1], device)
    return rows.view(torch.uint8), offset[-1] * values.element_size(), wr


def _edges(b0: int, nbytes: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """The head partial word, the whole words and the tail partial word of global bytes
    [b0, b0 + nbytes), as (start, stop) byte columns relative to b0."""
    b1 = b0 + nbytes
    a0 = min(-(-b0 // 4) * 4, b1)
    a1 = max(b1 // 4 * 4, a0)
    return (0, a0 - b0), (a0 - b0, a1 - b0), (a1 - b0, nbytes)


def box_checksum(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Checksum of `values`, the box at `offset` (size values.shape) of a tensor of `shape`.
    On a GPU it runs there (`box_checksum_torch`); on the host, one pass over the bytes."""
    if values.numel() == 0:
        return 0
    if values.device.type != "cpu":
        return box_checksum_torch(values, offset, shape)
    rows_t, b0, wr_t = _as_rows(values, offset, shape)
    rows = rows_t.numpy()
    nbytes = rows.shape[1]
    head, body, tail = _edges(b0, nbytes)
    sums = np.zeros(rows.shape[0], dtype=np.uint64)
    if body[1] > body[0]:
        words = rows[:, body[0] : body[1]].view(np.uint32)
        j0 = (b0 + body[0]) // 4
        sums += words @ _col_weights(j0, words.shape[1])  # uint32: wraps mod 2**32
    for start, stop in (head, tail):
        if stop > start:  # a partial word: its bytes in their lanes, times the word's weight
            g = b0 + start
            part = np.zeros(rows.shape[0], dtype=np.uint64)
            for k in range(start, stop):
                part += rows[:, k].astype(np.uint64) << np.uint64(8 * ((b0 + k) % 4))
            sums += part * np.uint64(_col_weight(g // 4))
    sums &= np.uint64(_MASK)
    total = (sums * wr_t.numpy().astype(np.uint64)).sum(dtype=np.uint64)  # each product < 2**63
    return int(total) & _MASK


def box_checksum_torch(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """`box_checksum` with torch integer ops on the tensor's device: the same number."""
    return int(box_checksum_tensor(values, offset, shape).item())


def box_checksum_tensor(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """`box_checksum_torch` as a 0-dim int64 tensor on the tensor's device, not read back."""
    dev = values.device
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=dev)
    rows, b0, wr = _as_rows(values, offset, shape, dev)
    nbytes = rows.shape[1]
    head, body, tail = _edges(b0, nbytes)
    sums = torch.zeros(rows.shape[0], dtype=torch.int64, device=dev)
    if body[1] > body[0]:
        b = rows[:, body[0] : body[1]]
        if b.storage_offset() % 4 or b.stride(0) % 4:  # a view as 32-bit words needs aligned rows
            b = b.clone(memory_format=torch.contiguous_format)
        words = b.view(torch.int32).to(torch.int64) & _MASK
        j0 = (b0 + body[0]) // 4
        wc = mix31(torch.arange(j0, j0 + words.shape[1], dtype=torch.int64, device=dev) + _COL_SALT) | 1
        sums += ((words * wc) & _MASK).sum(dim=1)  # each product < 2**63, each term < 2**32
    for start, stop in (head, tail):
        if stop > start:
            g = b0 + start
            part = torch.zeros(rows.shape[0], dtype=torch.int64, device=dev)
            for k in range(start, stop):
                part += rows[:, k].to(torch.int64) << (8 * ((b0 + k) % 4))
            sums += (part * _col_weight(g // 4)) & _MASK
    sums &= _MASK
    lo, hi = sums & 0xFFFF, sums >> 16  # sums * wr mod 2**32 without overflowing int64
    prod = (lo * wr + (((hi * wr) & 0xFFFF) << 16)) & _MASK
    return prod.sum() & _MASK


def read_sums(queued: dict) -> dict:
    """Sums queued on a device (`box_checksum_tensor`), by key, read back in one copy (mod P)."""
    keys = list(queued)
    values = torch.stack([queued[k] for k in keys]).tolist() if keys else []
    return {k: v % P for k, v in zip(keys, values)}


def combine(*parts: int) -> int:
    return sum(parts) % P
