"""Position-aware checksum, computed with tensor ops, combinable across pieces.

The tensor is seen as a matrix (rows = all leading dims, columns = last dim).
Every element's bits (16-bit limbs) are weighted by a hashed row weight times a
hashed column weight, both functions of the element's *global* position:

    checksum = sum_{r, c} bits[r, c] * wc[c] * wr[r]   mod P

The inner sum over columns is a float64 matrix-vector product (exact: every
partial sum stays below 2**53), so the checksum costs about one conversion and
one BLAS pass over the data. Checksums of disjoint boxes add up (mod P) to the
checksum of their union, so a sender can checksum the segments it sends and a
receiver the piece it holds, and they agree when every element arrived at its
position. Swapped rows, swapped columns and misplaced interleaves all change it."""

from __future__ import annotations

import functools

import torch

from .mixing import M31, flat_indices, mix31

P = M31  # 2**31 - 1, prime
_MAX_COLS = 1 << 20  # keeps |bits| * |wc| * cols < 2**53
_CHUNK_ELEMS = 1 << 20
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.lru_cache(maxsize=64)
def _col_weights(c0: int, n: int, limb: int) -> torch.Tensor:
    idx = torch.arange(c0, c0 + n, dtype=torch.int64)
    return (mix31(idx + 0x1B873593 + 7919 * limb) & 0xFFFF).to(torch.float64)


def _limbs(chunk: torch.Tensor) -> list[torch.Tensor]:
    size = chunk.element_size()
    bits = chunk.view(_INT_VIEW[size])
    if size <= 2:
        return [bits]
    wide = bits.to(torch.int64)
    return [((wide >> (16 * k)) & 0xFFFF) for k in range(size // 2)]


def box_checksum(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Checksum of `values`, the box at `offset` (size values.shape) of a tensor of `shape`."""
    if values.numel() == 0:
        return 0
    if values.device.type != "cpu":
        values = values.cpu()
    if values.dim() == 0:
        values, offset, shape = values.reshape(1), (0,), (1,)
    if values.dim() == 1:
        values, offset, shape = values.unsqueeze(0), (0, *offset), (1, *shape)
    lead_size = tuple(values.shape[:-1])
    ncols = values.shape[-1]
    c0 = offset[-1]
    rows2d = values.reshape(-1, ncols)  # a copy only when the box is strided in leading dims
    row_idx = flat_indices(offset[:-1], lead_size, shape[:-1]).reshape(-1)
    total = 0
    rows_per = max(1, _CHUNK_ELEMS // max(1, ncols))
    for cs in range(0, ncols, _MAX_COLS):
        cn = min(_MAX_COLS, ncols - cs)
        for r0 in range(0, rows2d.shape[0], rows_per):
            chunk = rows2d[r0 : r0 + rows_per, cs : cs + cn]
            if not chunk.is_contiguous():
                chunk = chunk.contiguous()
            wr = mix31(row_idx[r0 : r0 + rows_per] + 0x2545F491)
            for k, limb in enumerate(_limbs(chunk)):
                s = torch.mv(limb.to(torch.float64), _col_weights(c0 + cs, cn, k))
                s = torch.remainder(s.to(torch.int64), P)
                wk = wr if k == 0 else mix31(wr + k)
                total += int(torch.remainder(s * wk, P).sum())
    return total % P


def combine(*parts: int) -> int:
    return sum(parts) % P
