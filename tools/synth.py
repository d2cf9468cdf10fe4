"""Synthetic weights: a deterministic function of (seed, step, canonical tensor).

Step 0 is uniform in [-1, 1); each optimizer step adds to every element a
pseudo-random amount d with 0.02 <= |d| < 0.07 (sign flipped where the value
would leave [-3, 3]), computed in float32 and rounded to the tensor's dtype.
Since |d| exceeds a bf16 ulp over that range, every element changes each step.

Random numbers come from torch generators seeded per block of dim-0 rows, so any
box can be generated on its own: each trainer rank fills only what it holds and
anyone (tests included) regenerates any tensor independently."""

from __future__ import annotations

import math

import torch

from reshard.common.dataplane.mixing import salt_of

_BLOCK_ELEMS = 1 << 16
_LIMIT = 3.0


def _rows_per_block(shape: tuple[int, ...]) -> int:
    trailing = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, _BLOCK_ELEMS // max(1, trailing))


def _random_box(seed: int, name: str, step: int, offset, size, shape) -> torch.Tensor:
    """Uniform [0, 1) float32 values of box (offset, size) at `step`, by row blocks."""
    if not shape:
        g = torch.Generator().manual_seed(salt_of(seed, name, step, 0))
        return torch.rand((), generator=g)
    rpb = _rows_per_block(shape)
    r_lo, r_hi = offset[0], offset[0] + size[0]
    parts = []
    for b in range(r_lo // rpb, (r_hi - 1) // rpb + 1 if size[0] else r_lo // rpb):
        b0, b1 = b * rpb, min((b + 1) * rpb, shape[0])
        g = torch.Generator().manual_seed(salt_of(seed, name, step, b))
        block = torch.rand((b1 - b0, *shape[1:]), generator=g)
        sl = (slice(max(r_lo, b0) - b0, min(r_hi, b1) - b0),) + tuple(
            slice(o, o + s) for o, s in zip(offset[1:], size[1:])
        )
        parts.append(block[sl])
    if not parts:
        return torch.empty(size)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _row_chunks(out: torch.Tensor, offset, shape):
    """Split a box along dim 0 at block boundaries, about 1M elements at a time."""
    if out.dim() == 0:
        yield out, tuple(offset)
        return
    rpb = _rows_per_block(tuple(shape))
    step = rpb * max(1, (1 << 20) // max(1, rpb * max(1, out[0].numel())))
    r, end = offset[0], offset[0] + out.shape[0]
    while r < end:
        nxt = min(end, (r // step + 1) * step)
        yield out[r - offset[0] : nxt - offset[0]], (r, *offset[1:])
        r = nxt


def init_box(out: torch.Tensor, seed: int, name: str, offset, shape) -> None:
    """Write step-0 values of the box (offset, out.shape) of tensor `name` into `out`."""
    for view, off in _row_chunks(out, offset, shape):
        u = _random_box(seed, name, 0, off, tuple(view.shape), tuple(shape))
        view.copy_(u.mul_(2.0).sub_(1.0))


def advance_box(out: torch.Tensor, seed: int, name: str, step: int, offset, shape) -> None:
    """`out` holds the box at step-1; apply the optimizer step `step` in place."""
    for view, off in _row_chunks(out, offset, shape):
        d = _random_box(seed, name, step, off, tuple(view.shape), tuple(shape))
        d.mul_(0.1).sub_(0.05)  # [-0.05, 0.05)
        d.add_(torch.where(d < 0, -0.02, 0.02))
        w = view.to(device="cpu", dtype=torch.float32)  # computed on the host: the same bits on any device
        d = torch.where((w + d).abs() > _LIMIT, -d, d)
        view.copy_(w.add_(d))


def tensor_value(seed: int, name: str, step: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """The whole canonical tensor at `step`: an independent regeneration for tests."""
    out = torch.empty(tuple(shape), dtype=dtype)
    zero = tuple(0 for _ in shape)
    init_box(out, seed, name, zero, shape)
    for s in range(1, step + 1):
        advance_box(out, seed, name, s, zero, shape)
    return out
