"""The position-aware checksum and the synthetic weights, against plain tensor code."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reshard.common.dataplane.checksum import P, box_checksum, box_checksum_tensor, box_checksum_torch, combine
from reshard.common.dataplane.mixing import mix31
from reshard.tools.synth import advance_box, init_box, tensor_value


def _weight(i: int, salt: int) -> int:
    return int(mix31(torch.tensor([i + salt], dtype=torch.int64))[0]) | 1


def reference_checksum(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The checksum's definition, byte by byte with Python integers (common/dataplane/checksum.py's docstring)."""
    esize = values.element_size()
    data = values.contiguous().view(-1).view(torch.uint8).tolist()
    size = tuple(values.shape)
    lead_shape, lead_size = (shape[:-1], size[:-1]) if shape else ((), ())
    ncols = size[-1] if size else 1
    total, pos = 0, 0
    for local_row in range(len(data) // (ncols * esize)):
        rest, row = local_row, 0  # the global row index of this local row
        for d in reversed(range(len(lead_size))):
            rest, i = divmod(rest, lead_size[d])
            stride = 1
            for s in lead_shape[d + 1 :]:
                stride *= s
            row += (offset[d] + i) * stride
        wr = _weight(row, 0x2545F491)
        first = (offset[-1] if shape else 0) * esize
        for k in range(ncols * esize):
            g = first + k
            total += data[pos] * (1 << (8 * (g % 4))) * _weight(g // 4, 0x1B873593) * wr
            pos += 1
    return total % (1 << 32)


DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.float64, torch.uint8]


@given(dims=st.lists(st.integers(1, 9), min_size=0, max_size=3), seed=st.integers(0, 1000), dtype=st.sampled_from(DTYPES),
       data=st.data())
def test_checksum_matches_its_definition_on_both_paths(dims, seed, dtype, data):
    """The numpy path and the torch path (the one GPUs run) against a byte-by-byte reference,
    on boxes at any offset (odd ones: partial words at both edges)."""
    shape = tuple(dims)
    full = tensor_value(seed, "t", 1, shape, torch.float32).to(dtype) if shape else torch.tensor(1.5).to(dtype)
    off = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    size = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, off))
    box = full[tuple(slice(o, o + n) for o, n in zip(off, size))]
    want = reference_checksum(box, off, shape)
    assert box_checksum(box, off, shape) == want
    assert box_checksum_torch(box, off, shape) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
def test_host_and_torch_paths_agree_on_views(dtype):
    """The views the engine checksums: boxes at odd offsets, strided and transposed views, empty
    boxes, and boxes read from a uint8 staging buffer at odd byte offsets; the numpy path, the torch
    path and the torch path left on the device (read once) give the same number."""
    full = (torch.randn(13, 11) * 50).to(dtype)
    shape = tuple(full.shape)
    lead = 3 if full.element_size() == 1 else full.element_size()  # staged off 32-bit alignment where the dtype allows
    staged = torch.zeros(lead + full.numel() * full.element_size(), dtype=torch.uint8)[lead:].view(dtype).view(shape)
    staged.copy_(full)
    cases = [(full, (0, 0)), (full[3:9, 1:8], (3, 1)), (full[1:12:2, 5:], (1, 5)), (full[:, 7:8], (0, 7)),
             (full[2:2, 1:5], (2, 1)), (full[5:6, 3:3], (5, 3)), (full.t()[2:6, 1:9].t(), (1, 2)),
             (staged, (0, 0)), (staged[2:7, 3:10], (2, 3))]
    for box, off in cases:
        want = reference_checksum(box, off, shape) if box.numel() else 0
        assert box_checksum(box, off, shape) == box_checksum_torch(box, off, shape) == want, (off, tuple(box.shape))
        assert int(box_checksum_tensor(box, off, shape)) == want
    tile = full[4:10, 2:9].contiguous()  # the same box, contiguous or as a view: the same sum
    assert box_checksum(tile, (4, 2), shape) == box_checksum(full[4:10, 2:9], (4, 2), shape)


@given(rows=st.integers(1, 40), cols=st.integers(1, 40), cut=st.integers(0, 39), dtype=st.sampled_from(DTYPES))
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
