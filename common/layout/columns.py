"""Layouts held as columns.

A layout of a large model holds millions of pieces. The framework builders emit
them as numpy columns, one block per *class* (ranks with identical buffers), and
the planner reads those columns directly (`tables.build_table`). Python `Piece`
and `LocalBuffer` objects are made only for the ranks someone asks for
(`ColumnRanks[rank]`: a worker's own buffers, an error message, `to_json`).

`ClassCols` is also the planner's intermediate form for layouts built from
objects (hand-written, decoded from the wire): `from_buffers` reads them into the
same columns, so both kinds of layout go through one path and give the same
table, fingerprint and plan.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from reshard.common.layout.core import DTYPES, Box, LocalBuffer, Piece

DTYPE_IDS = {name: i for i, name in enumerate(DTYPES)}
DTYPE_NAMES = list(DTYPES)


def pad_rows(rows: list[tuple], n: int, fill: int, lens: np.ndarray | None = None) -> np.ndarray:
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


@dataclasses.dataclass(slots=True, eq=False)
class ClassCols:
    """The buffers of one class of ranks, as columns. Blocks may differ in width (the widest
    rank they hold); `concat` and `tables.build_table` bring them to one, and shorter rows are
    padded (offset 0, size 1).

    Names are ids: `buf_name` into the layout's buffer-name list, `p_tensor` into its tensor-name
    list (-1: a tensor the layout does not declare)."""

    buf_name: np.ndarray    # (B,)
    buf_dtype: np.ndarray   # (B,) index into DTYPES, -1 unknown
    buf_shape: np.ndarray   # (B, W)
    buf_ndim: np.ndarray    # (B,)
    buf_padding: dict[int, tuple[Box, ...]]
    p_tensor: np.ndarray    # (P,)
    p_buf: np.ndarray       # (P,) buffer row within the class; pieces are ordered by buffer
    p_flat: np.ndarray      # (P,) bool
    r_off: np.ndarray       # (P, W) region
    r_size: np.ndarray
    r_ndim: np.ndarray
    off: np.ndarray         # (P, W) box of the canonical tensor
    size: np.ndarray
    ndim: np.ndarray

    @property
    def num_buffers(self) -> int:
        return len(self.buf_name)

    @property
    def num_pieces(self) -> int:
        return len(self.p_tensor)

    def same(self, other: ClassCols) -> bool:
        """Equal content (same ids, shapes, pieces, padding)."""
        if self.num_buffers != other.num_buffers or self.num_pieces != other.num_pieces:
            return False
        if self.buf_padding != other.buf_padding:
            return False
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _ARRAYS)

    def widen(self, w: int) -> ClassCols:
        if self.buf_shape.shape[1] >= w:
            return self
        return dataclasses.replace(self, **{f: fit_width(getattr(self, f), w, 1 if f in _SIZES else 0) for f in _WIDE})

    @staticmethod
    def from_buffers(bufs: Sequence[LocalBuffer], tensor_id: dict[str, int], name_id: dict[str, int]) -> ClassCols:
        """Columns of Python buffers (names interned into `name_id` in order of first use)."""
        counts = np.fromiter(map(len, (b.pieces for b in bufs)), dtype=np.int64, count=len(bufs))
        allp = [p for b in bufs for p in b.pieces]
        regions = [p.region for p in allp]
        boxes = [p.box for p in allp]
        r_off, r_size = [r.offset for r in regions], [r.size for r in regions]
        x_off, x_size = [b.offset for b in boxes], [b.size for b in boxes]
        rndim = np.fromiter(map(len, r_size), dtype=np.int64, count=len(allp))
        ndim = np.fromiter(map(len, x_size), dtype=np.int64, count=len(allp))
        shapes = [b.shape for b in bufs]
        bndim = np.fromiter(map(len, shapes), dtype=np.int64, count=len(bufs))
        w = max(1, int(rndim.max(initial=0)), int(ndim.max(initial=0)), int(bndim.max(initial=0)))
        return ClassCols(
            buf_name=np.array([name_id.setdefault(b.name, len(name_id)) for b in bufs], dtype=np.int64),
            buf_dtype=np.array([DTYPE_IDS.get(b.dtype, -1) for b in bufs], dtype=np.int64),
            buf_shape=pad_rows(shapes, w, 1, bndim),
            buf_ndim=bndim,
            buf_padding={i: b.padding for i, b in enumerate(bufs) if b.padding},
            p_tensor=np.fromiter(map(tensor_id.get, (p.tensor for p in allp), itertools.repeat(-1)), dtype=np.int64,
                                 count=len(allp)),
            p_buf=np.repeat(np.arange(len(bufs), dtype=np.int64), counts),
            p_flat=np.fromiter((p.flat for p in allp), dtype=bool, count=len(allp)),
            r_off=pad_rows(r_off, w, 0, rndim), r_size=pad_rows(r_size, w, 1, rndim), r_ndim=rndim,
            off=pad_rows(x_off, w, 0, ndim), size=pad_rows(x_size, w, 1, ndim), ndim=ndim,
        )

    def to_buffers(self, tensor_names: Sequence[str], buffer_names: Sequence[str]) -> tuple[LocalBuffer, ...]:
        """The class as Python buffers."""
        bn, bd, bs = self.buf_name.tolist(), self.buf_ndim.tolist(), self.buf_shape.tolist()
        dts = self.buf_dtype.tolist()
        pt, pf = self.p_tensor.tolist(), self.p_flat.tolist()
        ro, rs, rn = self.r_off.tolist(), self.r_size.tolist(), self.r_ndim.tolist()
        xo, xs, xn = self.off.tolist(), self.size.tolist(), self.ndim.tolist()
        counts = np.bincount(self.p_buf, minlength=self.num_buffers).tolist()
        out, k = [], 0
        for b in range(self.num_buffers):
            pieces = []
            for j in range(k, k + counts[b]):
                pieces.append(Piece(tensor_names[pt[j]], Box(tuple(ro[j][:rn[j]]), tuple(rs[j][:rn[j]])),
                                    Box(tuple(xo[j][:xn[j]]), tuple(xs[j][:xn[j]])), bool(pf[j])))
            k += counts[b]
            out.append(LocalBuffer(buffer_names[bn[b]], tuple(bs[b][:bd[b]]), DTYPE_NAMES[dts[b]], tuple(pieces),
                                   self.buf_padding.get(b, ())))
        return tuple(out)


_WIDE = ("buf_shape", "r_off", "r_size", "off", "size")
_SIZES = ("buf_shape", "r_size", "size")
_ARRAYS = ("buf_name", "buf_dtype", "buf_shape", "buf_ndim", "p_tensor", "p_buf", "p_flat", "r_off", "r_size", "r_ndim",
           "off", "size", "ndim")


def fit_width(a: np.ndarray, w: int, fill: int) -> np.ndarray:
    """An (n, k) integer array as (n, w): extra columns cut, missing ones filled with `fill`
    (0 for offsets and strides, 1 for sizes); the array itself when it already has w."""
    if a.shape[1] >= w:
        return a if a.shape[1] == w else a[:, :w]
    out = np.full((a.shape[0], w), fill, dtype=np.int64)
    out[:, :a.shape[1]] = a
    return out


def concat(blocks: Sequence[ClassCols]) -> ClassCols:
    """One class made of blocks, in order (buffer rows renumbered)."""
    if len(blocks) == 1:
        return blocks[0]
    w = max(b.buf_shape.shape[1] for b in blocks)
    blocks = [b.widen(w) for b in blocks]
    nb = np.cumsum([0] + [b.num_buffers for b in blocks])
    padding = {}
    for base, b in zip(nb.tolist(), blocks):
        padding.update({base + i: p for i, p in b.buf_padding.items()})
    cat = {f: np.concatenate([getattr(b, f) for b in blocks]) for f in _ARRAYS if f != "p_buf"}
    cat["p_buf"] = np.concatenate([b.p_buf + base for base, b in zip(nb.tolist(), blocks)])
    return ClassCols(buf_padding=padding, **cat)


class ColumnRanks(Sequence):
    """`Layout.ranks` of a layout held as columns: rank r's buffers are made on first access and
    kept, one tuple per class (replicas share it, as they share one tuple in a built layout)."""

    def __init__(self, tensor_names: list[str], buffer_names: list[str], classes: list[ClassCols],
                 rank_class: Sequence[int]):
        self.tensor_names = tensor_names
        self.buffer_names = buffer_names
        self.classes = classes
        self.rank_class = list(rank_class)
        self._made: dict[int, tuple[LocalBuffer, ...]] = {}

    def __len__(self) -> int:
        return len(self.rank_class)

    def cls(self, c: int) -> tuple[LocalBuffer, ...]:
        made = self._made.get(c)
        if made is None:
            made = self._made[c] = self.classes[c].to_buffers(self.tensor_names, self.buffer_names)
        return made

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self.cls(c) for c in self.rank_class[i])
        return self.cls(self.rank_class[i])

    def __iter__(self):
        return (self.cls(c) for c in self.rank_class)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # like the layout it belongs to: compared, never hashed

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"ColumnRanks({len(self)} ranks, {len(self.classes)} classes)"


def merge_ranks(parts: Sequence, rank_part: Sequence[int]):
    """One layout from one-rank layouts (`parts`, each a `Layout` of one rank, columnar or not),
    rank r being parts[rank_part[r]]: columns end to end, one class per distinct part (ranks
    that declared the same buffers share it). Tensors declared by several parts must agree
    (LayoutError naming the first rank of each)."""
    from reshard.common.layout.core import Layout, LayoutError

    tensors: dict = {}
    first_rank = {}
    for r, k in enumerate(rank_part):
        first_rank.setdefault(k, r)
    for k, part in enumerate(parts):
        for n, t in part.tensors.items():
            have = tensors.setdefault(n, t)
            if have != t:
                other = next(first_rank[j] for j, q in enumerate(parts) if q.tensors.get(n) == have)
                raise LayoutError(f"tensor {n!r}: rank {first_rank[k]} declares {list(t.shape)} {t.dtype}, "
                                  f"rank {other} {list(have.shape)} {have.dtype}")
    tensor_names = sorted(tensors)
    tid = {n: i for i, n in enumerate(tensor_names)}
    name_id: dict[str, int] = {}
    classes = []
    for part in parts:
        if part.world != 1:
            raise LayoutError(f"a rank layout has {part.world} ranks, not 1")
        names, [cols], _ = layout_classes(part)
        part_tensors = part.ranks.tensor_names if isinstance(part.ranks, ColumnRanks) else sorted(part.tensors)
        tmap = np.array([tid[n] for n in part_tensors] + [-1], dtype=np.int64)
        nmap = np.array([name_id.setdefault(n, len(name_id)) for n in names], dtype=np.int64)
        classes.append(dataclasses.replace(cols, buf_name=nmap[cols.buf_name] if len(nmap) else cols.buf_name,
                                           p_tensor=tmap[np.where(cols.p_tensor < 0, len(part_tensors), cols.p_tensor)]))
    ranks = ColumnRanks(tensor_names, sorted(name_id, key=name_id.__getitem__), classes, list(rank_part))
    return Layout({n: tensors[n] for n in tensor_names}, ranks, any(p.allow_casts for p in parts))


# -- the wire form ------------------------------------------------------------------------

WIRE_MAGIC = b"RSL3c"  # then the inflated size (8 bytes, little-endian), then the zlib stream
_OLD_MAGICS = (b"RSL2c",)
_PIECE_FIELDS = ("p_tensor", "p_buf", "p_flat", "r_off", "r_size", "r_ndim", "off", "size", "ndim")
_BUF_FIELDS = ("buf_name", "buf_dtype", "buf_shape", "buf_ndim")


def layout_classes(layout) -> tuple[list[str], list[ClassCols], list[int]]:
    """(buffer names, classes as columns, each rank's class) of any layout: a columnar one as it
    is, one of Python buffers read once per distinct buffers object."""
    ranks = layout.ranks
    if isinstance(ranks, ColumnRanks):
        return ranks.buffer_names, ranks.classes, ranks.rank_class
    tid = {n: i for i, n in enumerate(sorted(layout.tensors))}
    by_id: dict[int, int] = {}
    classes: list[ClassCols] = []
    rank_class = []
    name_id: dict[str, int] = {}
    for bufs in ranks:
        c = by_id.get(id(bufs))
        if c is None:
            c = by_id[id(bufs)] = len(classes)
            classes.append(ClassCols.from_buffers(bufs, tid, name_id))
        rank_class.append(c)
    return sorted(name_id, key=name_id.__getitem__), classes, rank_class


def _narrow(a: np.ndarray) -> np.ndarray:
    if a.dtype == bool:
        return a.astype(np.uint8)
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        for t in (np.int8, np.int16, np.int32):
            if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
                return a.astype(t)
    return a.astype(np.int64)


def encode(layout) -> bytes:
    """The layout's wire form: a JSON header (tensors, buffer names, classes, padding) and the
    classes' columns as narrow little-endian integer arrays, zlib-compressed. Encoding and
    decoding are array copies, not per-piece work: a DeepSeek-V3 vLLM layout (1.1 million
    pieces) takes a fraction of a second each way."""
    import json

    names, classes, rank_class = layout_classes(layout)
    w = max([1] + [k.buf_shape.shape[1] for k in classes])
    classes = [k.widen(w) for k in classes]
    blobs, arrays = [], []
    for f in _BUF_FIELDS + _PIECE_FIELDS:
        parts = [getattr(k, f) for k in classes]
        a = _narrow(np.concatenate(parts) if parts else np.zeros((0, w) if f in _WIDE else 0, np.int64))
        a = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<")))
        arrays.append([f, a.dtype.str, list(a.shape)])
        blobs.append(a.tobytes())
    header = {
        "v": 2, "tensors": [[t.name, list(t.shape), t.dtype] for t in layout.tensors.values()],
        "allow_casts": layout.allow_casts, "dtypes": DTYPE_NAMES, "buffer_names": names, "rank_class": list(rank_class),
        "buffers": [k.num_buffers for k in classes], "pieces": [k.num_pieces for k in classes], "width": w,
        "padding": [[c, b, [p.to_json() for p in pads]] for c, k in enumerate(classes) for b, pads in sorted(k.buf_padding.items())],
        "arrays": arrays,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return wire(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def wire(raw: bytes) -> bytes:
    """The wire form of a layout's raw bytes: magic, the inflated size it declares, the zlib stream."""
    import zlib

    return WIRE_MAGIC + len(raw).to_bytes(8, "little") + zlib.compress(raw, 1)


def unwire(data: bytes, limit: int | None = None) -> bytes:
    """The raw bytes of a wire form. A declared size above `limit` (MAX_INFLATED) is refused before
    anything is inflated, and a stream that inflates to any other size is malformed."""
    from reshard.common.layout.core import LayoutError

    if data[:len(WIRE_MAGIC)] in _OLD_MAGICS:
        raise LayoutError("the layout comes from an older reshard version: run the same version on every controller and worker")
    if data[:len(WIRE_MAGIC)] != WIRE_MAGIC or len(data) < len(WIRE_MAGIC) + 8:
        raise LayoutError("malformed layout: not the reshard layout wire form")
    limit = MAX_INFLATED if limit is None else limit
    size = int.from_bytes(data[len(WIRE_MAGIC):len(WIRE_MAGIC) + 8], "little")
    if size > limit:
        raise LayoutError(f"layout refused: it declares {size} bytes inflated, over the limit of {limit >> 20} MiB")
    raw = inflate(data[len(WIRE_MAGIC) + 8:], size)
    if len(raw) != size:
        raise LayoutError(f"malformed layout: it declares {size} bytes inflated and inflates to {len(raw)}")
    return raw


MAX_INFLATED = 256 << 20  # a layout inflates to at most this (Kimi-K2 Megatron tp8 dp32 ep32: 32 MB)


def inflate(data: bytes, limit: int = MAX_INFLATED) -> bytes:
    """zlib-inflate at most `limit` bytes: a small message that would inflate past it (a
    decompression bomb) is refused before it takes the memory."""
    import zlib

    from reshard.common.layout.core import LayoutError

    d, parts, total, rest = zlib.decompressobj(), [], 0, data
    while True:  # in steps of 16 MiB: the memory never runs far past the limit
        chunk = d.decompress(rest, 16 << 20)
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise LayoutError(f"malformed layout: it inflates past the {limit} bytes it declares")
        rest = d.unconsumed_tail
        if not rest:
            break
    parts.append(d.flush())
    if total + len(parts[-1]) > limit:
        raise LayoutError(f"malformed layout: it inflates past {limit >> 20} MiB")
    return b"".join(parts)


def decode(data: bytes):
    """A layout from `encode`'s bytes (its ranks as `ColumnRanks`), checked for consistency:
    LayoutError on malformed input. (Whether the layout is valid is the planner's check.)"""
    import json
    import zlib

    from reshard.common.layout.core import Layout, LayoutError, TensorSpec

    try:
        raw = unwire(data)
        n = int.from_bytes(raw[:8], "little")
        h = json.loads(raw[8:8 + n])
        tensors = {name: TensorSpec(name, tuple(shape), dt) for name, shape, dt in h["tensors"]}
        pos, cols = 8 + n, {}
        for f, dt, shape in h["arrays"]:
            if f not in _BUF_FIELDS + _PIECE_FIELDS or np.dtype(dt).kind not in "iu":
                raise ValueError(f"unexpected array {f!r} of {dt}")
            size = int(np.prod(shape)) * np.dtype(dt).itemsize
            if pos + size > len(raw):
                raise ValueError("truncated arrays")
            cols[f] = np.frombuffer(raw, dtype=dt, count=int(np.prod(shape)), offset=pos).reshape(shape).astype(np.int64)
            pos += size
        nb, npc, w, names = list(h["buffers"]), list(h["pieces"]), int(h["width"]), list(h["buffer_names"])
        rank_class = [int(c) for c in h["rank_class"]]
        _check_wire(cols, nb, npc, w, len(tensors), len(names), rank_class)
        remap = np.array([DTYPE_IDS.get(d, -1) for d in h["dtypes"]] + [-1], dtype=np.int64)
        cols["buf_dtype"] = remap[np.where(cols["buf_dtype"] < 0, len(h["dtypes"]), cols["buf_dtype"])]
        cols["p_flat"] = cols["p_flat"].astype(bool)
        padding: dict[tuple[int, int], tuple[Box, ...]] = {}
        for c, b, pads in h["padding"]:
            padding[(int(c), int(b))] = tuple(Box(tuple(o), tuple(s)) for o, s in pads)
        classes = []
        b0 = p0 = 0
        for c, (bc, pc) in enumerate(zip(nb, npc)):
            kw = {f: cols[f][b0:b0 + bc] for f in _BUF_FIELDS}
            kw.update({f: cols[f][p0:p0 + pc] for f in _PIECE_FIELDS})
            classes.append(ClassCols(buf_padding={b: p for (cc, b), p in padding.items() if cc == c}, **kw))
            b0, p0 = b0 + bc, p0 + pc
        return Layout(tensors, ColumnRanks(sorted(tensors), names, classes, rank_class), bool(h.get("allow_casts", False)))
    except LayoutError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, zlib.error, UnicodeDecodeError) as e:
        raise LayoutError(f"malformed layout: {e}") from e


def _check_wire(cols: dict, nb: list[int], npc: list[int], w: int, ntensors: int, nnames: int, rank_class: list[int]) -> None:
    B, P = sum(nb), sum(npc)
    for f in _BUF_FIELDS + _PIECE_FIELDS:
        want = (B if f in _BUF_FIELDS else P,) + ((w,) if f in _WIDE else ())
        if cols.get(f) is None or cols[f].shape != want:
            raise ValueError(f"array {f!r} has shape {None if cols.get(f) is None else cols[f].shape}, not {want}")
    if any(c < 0 or c >= len(nb) for c in rank_class) or any(x < 0 for x in nb + npc):
        raise ValueError("class indexes out of range")
    if B and (cols["buf_name"].min() < 0 or cols["buf_name"].max() >= nnames):
        raise ValueError("buffer name ids out of range")
    if P and (cols["p_tensor"].min() < -1 or cols["p_tensor"].max() >= ntensors):
        raise ValueError("tensor ids out of range")
    for f in ("buf_ndim", "r_ndim", "ndim"):
        if len(cols[f]) and (cols[f].min() < 0 or cols[f].max() > w):
            raise ValueError(f"{f} out of range")
    # Pieces are ordered by buffer within each class, and name one of its buffers.
    pb = cols["p_buf"]
    cls_of = np.repeat(np.arange(len(npc)), npc)
    if P and ((pb < 0).any() or (pb >= np.array(nb)[cls_of]).any()
              or ((np.diff(pb) < 0) & (cls_of[1:] == cls_of[:-1])).any()):
        raise ValueError("piece buffer indexes out of range or out of order")
