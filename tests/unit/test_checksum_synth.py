"""The position-aware checksum and the synthetic weights, against plain tensor code."""

import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from reshard.common.dataplane import checksum
from reshard.common.dataplane.checksum import P, box_checksum, box_checksum_tensor, box_checksum_torch, combine, read_sums
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


@pytest.mark.parametrize("host_product", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
def test_host_and_torch_paths_agree_on_views(dtype, host_product, monkeypatch):
    """The views the engine checksums: boxes at odd offsets, strided and transposed views, empty
    boxes, and boxes read from a uint8 staging buffer at odd byte offsets; the host path (with
    torch's int32 product of aligned words, or numpy's for every word), the torch path and the
    torch path left on the device (read once) give the same number."""
    monkeypatch.setattr(checksum, "_MV_WRAPS", host_product == "torch")
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


def test_torchs_int32_product_wraps_here():
    """The host path's fast product is in use on this torch: its int32 matrix-vector product wraps
    mod 2**32 like numpy's unsigned one (each process checks it once before using it)."""
    assert checksum._torch_mv_wraps()


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


# -- the device path's cost, on CPU tensors: the same torch ops a GPU runs (issue 28, item 28) ---------------

class _Ops(TorchDispatchMode):
    """Every aten op the torch path dispatches, as a GPU would launch it: the ops that are not views
    nor bare allocations (`ops`), and the peak bytes of the tensors those ops made that were alive
    at once (`peak`; the caller's tensors excluded)."""

    NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach", "_local_scalar_dense"}

    def __init__(self):
        super().__init__()
        self.ops, self.live, self.peak, self._seen = [], 0, 0, set()

    def _free(self, key, n):
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view:
            return out
        if name not in self.NO_KERNEL:
            self.ops.append(name)
        inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                st = o.untyped_storage()
                if id(st) not in self._seen:
                    self._seen.add(id(st))
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, id(st), st.nbytes())
        return out


def _cost(fn):
    fn()  # the weight tables are made once per device: the steady state is measured
    with _Ops() as ops:
        fn()
    return ops


@given(dims=st.lists(st.integers(1, 7), min_size=0, max_size=4), seed=st.integers(0, 1000), dtype=st.sampled_from(DTYPES),
       chunk=st.sampled_from([1, 2, 3, 5, 8, 64]), lead=st.integers(0, 7),
       cast=st.sampled_from([None, torch.float32, torch.bfloat16]), data=st.data())
def test_torch_path_in_tiles_equals_the_host_path(dims, seed, dtype, chunk, lead, cast, data):
    """Tiles of a few words: rows in several tiles, a row's words in several blocks, leading dims that do
    not merge (a box cut in an inner one), partial words at both edges, staging at odd byte offsets,
    transposed views, and the sum of the values cast to another dtype (tile by tile): all the same
    number as the host path and the definition."""
    shape = tuple(dims)
    full = tensor_value(seed, "t", 1, shape, torch.float32).to(dtype) if shape else torch.tensor(1.5).to(dtype)
    off = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    size = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, off))
    box = full[tuple(slice(o, o + n) for o, n in zip(off, size))]
    if box.dim() >= 2 and data.draw(st.booleans()):
        box = box.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, last dim strided
    if lead:  # the box packed into a uint8 buffer at an odd offset, as in a staging bucket
        n = box.numel() * box.element_size()
        staged = torch.zeros(lead + n, dtype=torch.uint8)[lead:]
        if box.element_size() == 1 or lead % box.element_size() == 0:
            staged = staged.view(box.dtype).view(box.shape)
            staged.copy_(box)
            box = staged
    want = reference_checksum(box, off, shape)
    assert box_checksum(box, off, shape) == box_checksum_torch(box, off, shape, chunk_words=chunk) == want
    if cast is not None:
        want = reference_checksum(box.to(cast), off, shape)
        got = box_checksum_torch(box, off, shape, dtype=cast, chunk_words=chunk)
        assert box_checksum(box, off, shape, dtype=cast) == got == want


@pytest.mark.slow  # 2-3 s: the quick suite keeps under 5 minutes on 2 cores
def test_big_boxes_in_many_tiles_and_past_the_weight_tables(monkeypatch):
    """Boxes of many tiles (rows in tiles, one long row in blocks, a 3-D box whose leading dims do
    not merge), also with weight tables so small that every weight is hashed per tile and with
    host tiles of a few words: the same sums."""
    from reshard.common.dataplane import checksum

    g = torch.Generator().manual_seed(3)
    mat = torch.randint(-128, 128, (300, 1001), generator=g, dtype=torch.int8)
    vec = torch.randn(50_001, generator=g).to(torch.bfloat16)
    cube = torch.randn(9, 40, 33, generator=g)
    cases = [(mat[7:290, 3:1000], (7, 3), tuple(mat.shape)), (vec[5:], (5,), tuple(vec.shape)),
             (cube[2:8, 5:31, 1:], (2, 5, 1), tuple(cube.shape)), (cube.transpose(1, 2)[1:, 3:, 2:], (1, 3, 2), (9, 33, 40))]
    want = [box_checksum(v, o, s) for v, o, s in cases]
    for chunk in (7, 256, 5000):
        assert [box_checksum_torch(v, o, s, chunk_words=chunk) for v, o, s in cases] == want
    monkeypatch.setattr(checksum, "TABLE_ENTRIES", 16)
    monkeypatch.setattr(checksum, "NUMPY_CHUNK_WORDS", 5)
    monkeypatch.setattr(checksum, "_TABLES", checksum._Tables())
    assert [box_checksum(v, o, s) for v, o, s in cases] == want
    assert [box_checksum_torch(v, o, s, chunk_words=33) for v, o, s in cases] == want


def test_device_path_temporaries_are_bounded_by_the_tile(monkeypatch):
    """The torch path's temporaries stay within a few bytes per word of one tile, whatever the box's size:
    with tiles of 1024 words, a 512 KiB box (aligned, and at an odd column offset) peaks near 8 KiB of
    int64 products. It made int64 copies of the whole box: 6x its bytes at once (3 MiB here)."""
    from reshard.common.dataplane import checksum

    monkeypatch.setattr(checksum, "HOST_CHUNK_WORDS", 1024, raising=False)
    full = torch.randn(64, 4096).to(torch.bfloat16)  # 512 KiB: 128 tiles
    for box, off in ((full, (0, 0)), (full[:, 1:], (0, 1))):
        peak = _cost(lambda: box_checksum_tensor(box, off, tuple(full.shape))).peak
        assert peak <= 3 * 8 * 1024, f"{peak} bytes of temporaries at once for a box of {box.numel() * 2}"


def test_device_path_launches_a_few_ops_per_tile():
    """The ops a GPU runs per box (no view, no allocation): a segment in one tile takes 8 (its words times
    their column weights, masked, summed per row; the row sums masked, times their row weights, masked,
    summed; the result masked), its weights read from tables made once per device. It took 56 for any box
    (weights hashed per box in about 15 ops each, partial words byte by byte)."""
    full = torch.randn(256, 4096).to(torch.bfloat16)
    for box, off in ((full[:8, :64], (0, 0)), (full[16:48, 1024:3072], (16, 1024))):
        ops = _cost(lambda: box_checksum_tensor(box, off, tuple(full.shape))).ops
        assert len(ops) <= 8, ops
    # At an odd offset the words are first copied into zero-padded words (two more ops).
    assert len(_cost(lambda: box_checksum_tensor(full[:8, 1:64], (0, 1), tuple(full.shape))).ops) <= 10


def test_many_boxes_on_a_device_are_read_back_once(monkeypatch):
    """`box_checksums` (VERIFY's fallback, `receiver_checksums`) queues every box's sum and reads them back in
    one copy: no read per box (on a GPU each was a host sync). CPU tensors stand in for a device here."""
    from reshard.common.dataplane import checksum

    full = torch.randn(32, 48).to(torch.bfloat16)
    boxes = [(full[r : r + 4, c : c + 7], (r, c), (32, 48)) for r in range(0, 28, 9) for c in range(0, 40, 13)]
    want = [box_checksum(*b) for b in boxes]
    monkeypatch.setattr(checksum, "_on_host", lambda values: False)
    with _Ops() as ops:
        got = checksum.box_checksums(boxes)
    assert got == want
    assert "_local_scalar_dense" not in ops.ops and ops.ops.count("stack") == 1


def test_read_sums_adds_pairs_of_one_key():
    sums = {"a": [box_checksum_tensor(torch.arange(6.0).reshape(2, 3)[:, :2], (0, 0), (2, 3)),
                  box_checksum_tensor(torch.arange(6.0).reshape(2, 3)[:, 2:], (0, 2), (2, 3))]}
    got = read_sums([("a", c) for c in sums["a"]] + [("b", torch.tensor(P + 5))])
    assert got == {"a": box_checksum(torch.arange(6.0).reshape(2, 3), (0, 0), (2, 3)), "b": 5}
