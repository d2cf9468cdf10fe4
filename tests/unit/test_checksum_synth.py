"""The position-aware checksum and the synthetic weights, against plain tensor code."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reshard.common.checksum import P, box_checksum, combine
from reshard.common.synth import advance_box, init_box, tensor_value


@given(rows=st.integers(1, 40), cols=st.integers(1, 40), cut=st.integers(0, 39), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_checksum_is_additive_over_any_split(rows, cols, cut, dtype):
    t = tensor_value(1, "x", 1, (rows, cols), dtype)
    whole = box_checksum(t, (0, 0), (rows, cols))
    r = cut % rows
    c = cut % cols
    parts = [box_checksum(t[:r, :c], (0, 0), (rows, cols)), box_checksum(t[:r, c:], (0, c), (rows, cols)),
             box_checksum(t[r:, :c], (r, 0), (rows, cols)), box_checksum(t[r:, c:], (r, c), (rows, cols))]
    assert combine(*parts) == whole


def test_checksum_sees_positions():
    t = tensor_value(2, "y", 3, (16, 32), torch.bfloat16)
    base = box_checksum(t, (0, 0), (16, 32))
    def swap_rows(u):
        u[[1, 2]] = u[[2, 1]].clone()

    def swap_cols(u):
        u[:, [3, 4]] = u[:, [4, 3]].clone()

    def bump(u):
        u[5, 6] += 1.0

    for mutate in (swap_rows, swap_cols, bump):
        u = t.clone()
        mutate(u)
        assert not torch.equal(u, t)
        assert box_checksum(u, (0, 0), (16, 32)) != base
    # The same values at another offset of a larger tensor give another checksum.
    assert box_checksum(t, (16, 0), (32, 32)) != base
    assert 0 <= base < P


@pytest.mark.parametrize("shape", [(7,), (5, 9), (3, 4, 6)])
def test_synthetic_weights_boxes_and_steps(shape):
    full0 = tensor_value(4, "w", 0, shape, torch.bfloat16)
    full2 = tensor_value(4, "w", 2, shape, torch.bfloat16)
    full3 = tensor_value(4, "w", 3, shape, torch.bfloat16)
    assert (full2 != full3).all(), "every element changes every step"
    assert full3.float().std() > 0.3  # random-looking, not a constant
    # Any box regenerates on its own.
    off = tuple(s // 3 for s in shape)
    size = tuple(s - o for s, o in zip(shape, off))
    box = torch.empty(size, dtype=torch.bfloat16)
    init_box(box, 4, "w", off, shape)
    sl = tuple(slice(o, o + s) for o, s in zip(off, size))
    assert torch.equal(box, full0[sl])
    for step in (1, 2, 3):
        advance_box(box, 4, "w", step, off, shape)
    assert torch.equal(box, full3[sl])
    assert not torch.equal(tensor_value(5, "w", 3, shape, torch.bfloat16), full3)  # the seed matters
