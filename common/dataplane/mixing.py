"""Integer hashing with tensor ops, safe from int64 overflow.

Every multiplication keeps both factors below 2**31, so products stay below
2**62 and no intermediate result wraps. Used by the checksum and by the
synthetic weights (random access: any box can be generated on its own)."""

from __future__ import annotations

import torch

M31 = 0x7FFFFFFF
_K = (0x5BD1E995 & M31, 0x27D4EB2F & M31, 0x165667B1 & M31)


def mix31(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit avalanche hash of non-negative int64 values (< 2**62)."""
    x = (x ^ (x >> 31)) & M31
    for k in _K:
        x = (x * k) & M31
        x = x ^ (x >> 15)
    return x


def salt_of(*parts: object) -> int:
    """A stable 31-bit salt for a tuple of names and numbers (independent of PYTHONHASHSEED)."""
    h = 0xCBF29CE484222325
    for part in parts:
        for byte in repr(part).encode():
            h ^= byte
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return (h ^ (h >> 31)) & M31


def flat_indices(offset: tuple[int, ...], size: tuple[int, ...], shape: tuple[int, ...],
                 device: torch.device | None = None) -> torch.Tensor:
    """Row-major global flat indices (int64, shaped `size`, on `device`) of a box of a tensor of `shape`."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    strides = []
    for s in reversed(shape):
        strides.append(stride)
        stride *= s
    strides.reverse()
    nd = len(size)
    for d in range(nd):
        ar = torch.arange(offset[d], offset[d] + size[d], dtype=torch.int64, device=device) * strides[d]
        idx = idx.unsqueeze(-1) + ar.view(*([1] * d), size[d]) if d else ar
    return idx.reshape(size) if nd else idx


