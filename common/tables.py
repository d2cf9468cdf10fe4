"""Columnar form of a layout: the planner's input, built in one pass over the pieces.

Ranks that hold identical buffers (data-parallel copies, replicas built from one
object) form one *class*; a class's pieces are read once, whatever the number of
its ranks. Each piece becomes one row of numpy columns (tensor id, box, region,
buffer), so validation, intersections and plans run as array operations instead
of per-piece Python.

Validation here is a fast, sufficient test: a class that passes every vectorized
check is valid. A class that fails one (or that the fast test cannot decide,
such as interleaved regions in one buffer) is checked by the exact
`Layout.validate_rank`, which raises the error naming the tensor, rank and
problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import numpy as np

from .layout import DTYPES, Layout, LocalBuffer

DTYPE_IDS = {name: i for i, name in enumerate(DTYPES)}
ITEMSIZE = np.array([dt.itemsize for dt in DTYPES.values()], dtype=np.int64)


def _pad(rows: list[tuple], n: int, fill: int, lens: np.ndarray | None = None) -> np.ndarray:
    """Tuples of length <= n as an (len, n) int64 array, right-filled with `fill`."""
    if lens is None:
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    total = int(lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
    if total == n * len(rows):
        return flat.reshape(len(rows), n)
    out = np.empty((len(rows), n), dtype=np.int64)
    out.fill(fill)
    ends = np.cumsum(lens)
    for k in range(1, n + 1):
        # Rows of length k: their values sit at ends-k .. ends-1 of the flat run.
        sel = np.flatnonzero(lens == k)
        if sel.size:
            base = ends[sel] - k
            out[sel, :k] = flat[base[:, None] + np.arange(k)[None, :]]
    return out


def row_strides(size: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Row-major strides of each row's size (dims past ndim get stride 0)."""
    D = size.shape[1]
    out = np.zeros_like(size)
    acc = np.ones(len(size), dtype=np.int64)
    for d in range(D - 1, -1, -1):
        live = d < ndim
        out[:, d] = np.where(live, acc, 0)
        acc = np.where(live, acc * size[:, d], acc)
    return out


@dataclasses.dataclass(slots=True)
class LayoutTable:
    """One layout as columns. `D` is the widest tensor/buffer rank; shorter rows are padded
    (offset 0, size 1, stride 0)."""

    layout: Layout
    D: int
    tensor_names: list[str]          # sorted; tensor id = index
    tensor_shape: np.ndarray         # (T, D)
    tensor_ndim: np.ndarray          # (T,)
    tensor_dtype: np.ndarray         # (T,)
    rank_class: np.ndarray           # (world,) class of each rank
    class_ranks: list[list[int]]     # ranks of each class, ascending; class order = first rank
    # buffers (one row per buffer of each class)
    buf_class: np.ndarray
    buf_name: np.ndarray             # name id into `names` (shared name table)
    buf_dtype: np.ndarray
    buf_shape: np.ndarray            # (B, D)
    buf_ndim: np.ndarray
    buf_numel: np.ndarray
    buf_strides: np.ndarray          # (B, D)
    buf_obj: list[LocalBuffer]
    # pieces (one row per piece of each class's buffers)
    p_tensor: np.ndarray             # tensor id, -1 when unknown
    p_index: np.ndarray              # index of the piece in its buffer
    p_buf: np.ndarray                # buffer row
    p_flat: np.ndarray
    p_off: np.ndarray                # box offset (P, D)
    p_size: np.ndarray               # box size (P, D)
    p_ndim: np.ndarray               # box rank
    p_start: np.ndarray              # flat element offset of the box's first element in the buffer
    p_strides: np.ndarray            # (P, D) element strides of the box inside the buffer
    p_numel: np.ndarray
    problems: np.ndarray             # (classes,) bool: the fast checks could not clear this class

    @property
    def num_classes(self) -> int:
        return len(self.class_ranks)

    def fingerprint(self) -> str:
        """A digest of the layout's content, equal for equal layouts however they were built."""
        h = hashlib.sha256()
        h.update(repr((self.layout.allow_casts, self.tensor_names)).encode())
        h.update("\0".join(b.name for b in self.buf_obj).encode())
        h.update(repr([(i, b.padding) for i, b in enumerate(self.buf_obj) if b.padding]).encode())
        for a in (self.tensor_shape, self.tensor_dtype, self.rank_class, self.buf_class, self.buf_dtype, self.buf_shape,
                  self.p_tensor, self.p_index, self.p_buf, self.p_flat, self.p_off, self.p_size, self.p_start, self.p_strides):
            h.update(np.ascontiguousarray(a))
        return h.hexdigest()[:32]


def build_table(layout: Layout, names: dict[str, int], side: str = "layout", require_full_buffers: bool = True,
                check: bool = True) -> LayoutTable:
    """Columns of `layout` (buffer names interned into `names`), checked unless `check` is
    false: raises LayoutError on an invalid layout."""
    tnames = sorted(layout.tensors)
    tid = {n: i for i, n in enumerate(tnames)}
    specs = [layout.tensors[n] for n in tnames]

    # Classes: ranks sharing one buffers object are read once; distinct objects with equal
    # content (hand-built or decoded layouts) are merged below by a digest of their columns.
    by_id: dict[int, int] = {}
    firsts: list[tuple] = []
    id_class = []
    for bufs in layout.ranks:
        c = by_id.get(id(bufs))
        if c is None:
            c = by_id[id(bufs)] = len(firsts)
            firsts.append(bufs)
        id_class.append(c)

    # One pass over the pieces of each class.
    b_class, b_name, b_dtype, b_shape, b_obj = [], [], [], [], []
    r_off, r_size, x_off, x_size = [], [], [], []
    b_first, p_first = [], []
    dt_ids = DTYPE_IDS
    p_tens: list[str] = []
    p_idx: list[np.ndarray] = []
    p_bufi: list[np.ndarray] = []
    p_flat_l: list[bool] = []
    for c, bufs in enumerate(firsts):
        b_first.append(len(b_obj))
        p_first.append(len(p_tens))
        base = len(b_obj)
        b_obj.extend(bufs)
        b_class.extend([c] * len(bufs))
        b_name.extend([names.setdefault(b.name, len(names)) for b in bufs])
        b_dtype.extend([dt_ids.get(b.dtype, -1) for b in bufs])
        b_shape.extend([b.shape for b in bufs])
        allp = [p for b in bufs for p in b.pieces]
        counts = np.fromiter(map(len, (b.pieces for b in bufs)), dtype=np.int64, count=len(bufs))
        p_tens.extend([p.tensor for p in allp])
        p_idx.append(np.arange(len(allp)) - np.repeat(np.cumsum(counts) - counts, counts))
        p_bufi.append(np.repeat(np.arange(base, base + len(bufs)), counts))
        p_flat_l.extend([p.flat for p in allp])
        regions = [p.region for p in allp]
        boxes = [p.box for p in allp]
        r_off.extend([r.offset for r in regions])
        r_size.extend([r.size for r in regions])
        x_off.extend([b.offset for b in boxes])
        x_size.extend([b.size for b in boxes])
    b_first.append(len(b_obj))
    p_first.append(len(p_tens))
    rndim = np.fromiter(map(len, r_size), dtype=np.int64, count=len(r_size))
    ndim = np.fromiter(map(len, x_size), dtype=np.int64, count=len(x_size))
    D = max([1] + [len(s.shape) for s in specs] + [len(s) for s in b_shape] + [int(rndim.max(initial=0)), int(ndim.max(initial=0))])

    t_shape = _pad([s.shape for s in specs], D, 1)
    t_ndim = np.array([len(s.shape) for s in specs], dtype=np.int64)
    t_dtype = np.array([dt_ids.get(s.dtype, -1) for s in specs], dtype=np.int64)
    bshape = _pad(b_shape, D, 1)
    bndim = np.array([len(s) for s in b_shape], dtype=np.int64)
    rows = np.empty((len(p_tens), 4), dtype=np.int64)
    rows[:, 0] = np.fromiter(map(tid.get, p_tens, itertools.repeat(-1)), dtype=np.int64, count=len(p_tens))
    rows[:, 1] = np.concatenate(p_idx) if p_idx else 0
    rows[:, 2] = np.concatenate(p_bufi) if p_bufi else 0
    rows[:, 3] = p_flat_l
    del p_tens, p_idx, p_bufi, p_flat_l
    roff, rsize = _pad(r_off, D, 0, rndim), _pad(r_size, D, 1, rndim)
    del r_off, r_size
    off, size = _pad(x_off, D, 0, ndim), _pad(x_size, D, 1, ndim)
    del x_off, x_size
    b_class_a = np.array(b_class, dtype=np.int64)
    b_name_a = np.array(b_name, dtype=np.int64)
    b_dtype_a = np.array(b_dtype, dtype=np.int64)

    # Merge id-classes with equal content: a digest of their columns finds candidates, == decides.
    canon = list(range(len(firsts)))
    if len(firsts) > 1:
        seen: dict[bytes, list[int]] = {}
        for c in range(len(firsts)):
            p0, p1, b0, b1 = p_first[c], p_first[c + 1], b_first[c], b_first[c + 1]
            # Both ends of the class (dense layers lead, experts trail): a cheap key; equal keys
            # are compared in full.
            h = hashlib.sha256()
            h.update(np.array([p1 - p0, b1 - b0], dtype=np.int64))
            for lo_, hi_ in ((p0, min(p1, p0 + 64)), (max(p0, p1 - 64), p1)):
                for a in (rows[lo_:hi_, :2], off[lo_:hi_], size[lo_:hi_]):
                    h.update(np.ascontiguousarray(a))
            h.update(np.ascontiguousarray(b_name_a[b0:b1]))
            reps = seen.setdefault(h.digest(), [])
            for c0 in reps:
                if firsts[c0] == firsts[c]:
                    canon[c] = c0
                    break
            else:
                reps.append(c)
    keep_cls = np.array([canon[c] == c for c in range(len(firsts))], dtype=bool)
    new_id = np.cumsum(keep_cls) - 1
    rank_class = new_id[np.array([canon[c] for c in id_class], dtype=np.int64)] if id_class else np.zeros(0, np.int64)
    class_ranks: list[list[int]] = [[] for _ in range(int(keep_cls.sum()))]
    for r, c in enumerate(rank_class.tolist()):
        class_ranks[c].append(r)
    if not keep_cls.all():
        bkeep = keep_cls[b_class_a]
        bmap = np.cumsum(bkeep) - 1
        pkeep = bkeep[rows[:, 2]]
        rows = rows[pkeep]
        rows[:, 2] = bmap[rows[:, 2]]
        roff, rsize, rndim, off, size, ndim = (a[pkeep] for a in (roff, rsize, rndim, off, size, ndim))
        b_name_a, b_dtype_a, bshape, bndim = (a[bkeep] for a in (b_name_a, b_dtype_a, bshape, bndim))
        b_class_a = new_id[b_class_a[bkeep]]
        b_obj = [b for b, k in zip(b_obj, bkeep.tolist()) if k]
    else:
        b_class_a = new_id[b_class_a]

    p_tensor, p_index, p_buf, p_flat = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3].astype(bool)
    bnumel = bshape.prod(axis=1)
    bstrides = row_strides(bshape, bndim)
    numel = size.prod(axis=1)
    # Where each box sits in its buffer.
    start = np.where(p_flat, roff[:, 0], (roff * bstrides[p_buf]).sum(axis=1))
    strides = np.where(p_flat[:, None], row_strides(size, ndim), bstrides[p_buf])

    tbl = LayoutTable(
        layout, D, tnames, t_shape, t_ndim, t_dtype, rank_class, class_ranks,
        b_class_a, b_name_a, b_dtype_a, bshape, bndim, bnumel, bstrides, b_obj,
        p_tensor, p_index, p_buf, p_flat, off, size, ndim, start, strides, numel,
        np.zeros(len(class_ranks), dtype=bool))
    if not check:
        return tbl
    _fast_checks(tbl, roff, rsize, rndim, require_full_buffers)
    for c in np.flatnonzero(tbl.problems):
        layout.validate_rank(class_ranks[c][0], side, require_full_buffers)  # raises with the exact message
    return tbl


def _fast_checks(t: LayoutTable, roff, rsize, rndim, require_full: bool) -> None:
    """Mark classes that the vectorized (sufficient) checks do not clear."""
    bad = np.zeros(len(t.p_tensor), dtype=bool)  # per piece
    known = t.p_tensor >= 0
    bad |= ~known
    tix = np.where(known, t.p_tensor, 0)
    pb = t.p_buf
    # Box inside its tensor, same rank.
    bad |= t.p_ndim != t.tensor_ndim[tix]
    bad |= ((t.p_off + t.p_size) > t.tensor_shape[tix]).any(axis=1)
    # Dtype: the buffer's must be the tensor's unless casts are declared.
    if not t.layout.allow_casts:
        bad |= t.buf_dtype[pb] != t.tensor_dtype[tix]
    bad |= t.buf_dtype[pb] < 0
    # Regions.
    flat = t.p_flat
    bad |= flat & ((rndim != 1) | (rsize[:, 0] != t.p_numel) | (roff[:, 0] + rsize[:, 0] > t.buf_numel[pb]))
    nf = ~flat
    bad |= nf & ((rndim != t.p_ndim) | (rndim != t.buf_ndim[pb]) | (rsize != t.p_size).any(axis=1)
                 | ((roff + rsize) > t.buf_shape[pb]).any(axis=1))
    cls_bad = np.zeros(t.num_classes, dtype=bool)
    np.logical_or.at(cls_bad, t.buf_class[pb[bad]], True)

    # Duplicate buffer names in a class.
    if len(t.buf_class):
        o = np.lexsort((t.buf_name, t.buf_class))
        same = (t.buf_class[o][1:] == t.buf_class[o][:-1]) & (t.buf_name[o][1:] == t.buf_name[o][:-1])
        cls_bad[t.buf_class[o][1:][same]] = True

    # Disjointness and coverage inside each buffer, on linear spans: pieces and padding whose
    # spans do not overlap are disjoint (a sufficient test).
    lo = t.p_start
    last = ((t.p_size - 1) * t.p_strides).sum(axis=1)
    hi = lo + last + 1
    live = t.p_numel > 0
    s_buf, s_lo, s_hi, s_n = [pb[live]], [lo[live]], [hi[live]], [t.p_numel[live]]
    pads = [(bi, p) for bi, b in enumerate(t.buf_obj) for p in b.padding]
    if pads:
        pb2 = np.array([bi for bi, _ in pads], dtype=np.int64)
        poff = _pad([p.offset for _, p in pads], t.D, 0)
        psize = _pad([p.size for _, p in pads], t.D, 1)
        pnd = np.array([len(p.size) for _, p in pads], dtype=np.int64)
        pbad = (pnd != t.buf_ndim[pb2]) | ((poff + psize) > t.buf_shape[pb2]).any(axis=1)
        cls_bad[t.buf_class[pb2[pbad]]] = True
        pn = psize.prod(axis=1)
        st = t.buf_strides[pb2]
        plo = (poff * st).sum(axis=1)
        phi = plo + ((psize - 1) * st).sum(axis=1) + 1
        keep = pn > 0
        s_buf.append(pb2[keep]); s_lo.append(plo[keep]); s_hi.append(phi[keep]); s_n.append(pn[keep])
    sb, sl, sh, sn = (np.concatenate(x) for x in (s_buf, s_lo, s_hi, s_n))
    o = np.lexsort((sl, sb))
    sb, sl, sh, sn = sb[o], sl[o], sh[o], sn[o]
    overlap = (sb[1:] == sb[:-1]) & (sl[1:] < sh[:-1])
    cls_bad[t.buf_class[sb[1:][overlap]]] = True
    if require_full:
        covered = np.bincount(sb, weights=sn, minlength=len(t.buf_obj)) if len(sb) else np.zeros(len(t.buf_obj))
        gap = covered != t.buf_numel
        cls_bad[t.buf_class[gap]] = True
    t.problems = cls_bad


def unique_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(np.stack(cols, 1), axis=0, return_inverse=True) for non-negative integer
    columns, through one mixed-radix key: the same rows, order and inverse, without the
    row-wise sort (which takes ~0.6 s on 700k rows here)."""
    cols = [np.asarray(c, dtype=np.int64) for c in cols]
    n = len(cols[0])
    if not n:
        return np.zeros((0, len(cols)), dtype=np.int64), np.zeros(0, dtype=np.int64)
    radix = [int(c.max()) + 1 for c in cols]
    if any(int(c.min()) < 0 for c in cols) or float(np.prod([float(r) for r in radix])) >= 2.0 ** 62:
        u, inv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
        return u, inv.reshape(-1)
    key = np.zeros(n, dtype=np.int64)
    for c, r in zip(cols, radix):
        key = key * r + c
    ukey, inv = np.unique(key, return_inverse=True)
    out = np.empty((len(ukey), len(cols)), dtype=np.int64)
    for j in range(len(cols) - 1, -1, -1):
        ukey, out[:, j] = np.divmod(ukey, radix[j])
    return out, inv.reshape(-1)


def layout_fingerprint(layout: Layout) -> str:
    return build_table(layout, {}, require_full_buffers=False, check=False).fingerprint()


def contiguous(size: np.ndarray, strides: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Per row: are `strides` row-major contiguous for `size` (dims of size 1 ignored)?"""
    want = row_strides(size, ndim)
    return ((size == 1) | (strides == want)).all(axis=1)
