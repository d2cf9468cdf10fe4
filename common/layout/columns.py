"""The column form: how every layout holds its ranks.

A layout of a large model holds millions of pieces. The framework builders emit
them as numpy columns, one block per *class* (ranks with identical buffers), the
wire form carries them, and the planner reads them directly (`tables.build_table`).
Python `Piece` and `LocalBuffer` objects are a view, made only for the ranks
someone asks for (`ColumnRanks[rank]`: a worker's own buffers, an error message).

A layout written by hand as Python buffers (a test, an engine integration that
reads a live model) is read into the same columns once, when the `Layout` is
made (`ColumnRanks.of_buffers`), and keeps its buffers as that view: every
layout goes through one path and gives the same table, fingerprint and plan.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from reshard.common.layout.values import DTYPES, Box, LayoutError, LocalBuffer, Piece, TensorSpec

DTYPE_IDS = {name: i for i, name in enumerate(DTYPES)}
DTYPE_NAMES = list(DTYPES)
_VIEW_DTYPES = DTYPE_NAMES + ["unknown"]  # id -1: a dtype the sender's reshard did not know


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
    list; a negative `p_tensor` -1-k names the k-th tensor the layout does not declare (kept so
    that the validator can name it)."""

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
    def from_buffers(bufs: Sequence[LocalBuffer], tensor_id: dict[str, int], name_id: dict[str, int],
                     undeclared: dict[str, int] | None = None) -> ClassCols:
        """Columns of Python buffers (buffer names interned into `name_id`, and names of tensors
        missing from `tensor_id` into `undeclared`, in order of first use)."""
        undeclared = {} if undeclared is None else undeclared

        def tensor(n: str) -> int:
            i = tensor_id.get(n)
            return -1 - undeclared.setdefault(n, len(undeclared)) if i is None else i

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
            p_tensor=np.fromiter(map(tensor, (p.tensor for p in allp)), dtype=np.int64, count=len(allp)),
            p_buf=np.repeat(np.arange(len(bufs), dtype=np.int64), counts),
            p_flat=np.fromiter((p.flat for p in allp), dtype=bool, count=len(allp)),
            r_off=pad_rows(r_off, w, 0, rndim), r_size=pad_rows(r_size, w, 1, rndim), r_ndim=rndim,
            off=pad_rows(x_off, w, 0, ndim), size=pad_rows(x_size, w, 1, ndim), ndim=ndim,
        )

    def to_buffers(self, tensor_names: Sequence[str], buffer_names: Sequence[str],
                   undeclared: Sequence[str] = ()) -> tuple[LocalBuffer, ...]:
        """The class as Python buffers."""
        # Undeclared tensors at the end, reversed: index -1-k is then undeclared[k].
        tensor_names = list(tensor_names) + list(reversed(undeclared))
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
            out.append(LocalBuffer(buffer_names[bn[b]], tuple(bs[b][:bd[b]]), _VIEW_DTYPES[dts[b]], tuple(pieces),
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
    """`Layout.ranks`: every rank's buffers as columns, one `ClassCols` per class. Rank r's
    buffers (`ranks[r]`) are a view made on first access and kept, one tuple per class
    (replicas share it)."""

    def __init__(self, tensor_names: list[str], buffer_names: list[str], classes: list[ClassCols],
                 rank_class: Sequence[int], undeclared: Sequence[str] = (),
                 views: dict[int, tuple[LocalBuffer, ...]] | None = None):
        self.tensor_names = tensor_names
        self.buffer_names = buffer_names
        self.classes = classes
        self.rank_class = list(rank_class)
        self.undeclared = list(undeclared)
        self._made: dict[int, tuple[LocalBuffer, ...]] = dict(views or {})

    @staticmethod
    def of_buffers(tensor_names: list[str], ranks: Sequence[Sequence[LocalBuffer]]) -> ColumnRanks:
        """Columns of per-rank Python buffers: one class per distinct buffers object (replicas
        that share one share a class), each read once and kept as its class's view."""
        tid = {n: i for i, n in enumerate(tensor_names)}
        by_id: dict[int, int] = {}
        classes: list[ClassCols] = []
        views: dict[int, tuple[LocalBuffer, ...]] = {}
        rank_class = []
        name_id: dict[str, int] = {}
        undeclared: dict[str, int] = {}
        for bufs in ranks:
            c = by_id.get(id(bufs))
            if c is None:
                c = by_id[id(bufs)] = len(classes)
                views[c] = tuple(bufs)
                classes.append(ClassCols.from_buffers(views[c], tid, name_id, undeclared))
            rank_class.append(c)
        return ColumnRanks(tensor_names, sorted(name_id, key=name_id.__getitem__), classes, rank_class,
                           sorted(undeclared, key=undeclared.__getitem__), views)

    def tensor_name(self, i: int) -> str:
        return self.tensor_names[i] if i >= 0 else self.undeclared[-1 - i]

    def __len__(self) -> int:
        return len(self.rank_class)

    def cls(self, c: int) -> tuple[LocalBuffer, ...]:
        made = self._made.get(c)
        if made is None:
            made = self._made[c] = self.classes[c].to_buffers(self.tensor_names, self.buffer_names, self.undeclared)
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


def merged_classes(parts: Sequence[ColumnRanks], tensor_names: list[str]) -> tuple[list[str], list[ClassCols], list[str]]:
    """The classes of one-rank layouts' ranks (each part's one class) renumbered into shared
    buffer-name and tensor-name lists: (buffer names, classes, undeclared tensor names)."""
    tid = {n: i for i, n in enumerate(tensor_names)}
    name_id: dict[str, int] = {}
    undeclared: dict[str, int] = {}
    classes = []
    for part in parts:
        [cols] = part.classes
        names = part.tensor_names + part.undeclared[::-1]  # indexable by the part's ids, -1-k too
        tmap = np.array([tid[n] if n in tid else -1 - undeclared.setdefault(n, len(undeclared)) for n in names]
                        or [0], dtype=np.int64)
        nmap = np.array([name_id.setdefault(n, len(name_id)) for n in part.buffer_names] or [0], dtype=np.int64)
        classes.append(dataclasses.replace(cols, buf_name=nmap[cols.buf_name], p_tensor=tmap[cols.p_tensor]))
    return sorted(name_id, key=name_id.__getitem__), classes, sorted(undeclared, key=undeclared.__getitem__)


# -- the wire form ------------------------------------------------------------------------

WIRE_MAGIC = b"RSL3c"  # then the inflated size (8 bytes, little-endian), then the zlib stream
_OLD_MAGICS = (b"RSL2c",)
_PIECE_FIELDS = ("p_tensor", "p_buf", "p_flat", "r_off", "r_size", "r_ndim", "off", "size", "ndim")
_BUF_FIELDS = ("buf_name", "buf_dtype", "buf_shape", "buf_ndim")


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

    ranks = layout.ranks
    names, classes, rank_class = ranks.buffer_names, ranks.classes, ranks.rank_class
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
        "allow_casts": layout.allow_casts, "receive_window": layout.receive_window, "dtypes": DTYPE_NAMES, "buffer_names": names, "rank_class": list(rank_class),
        "undeclared": ranks.undeclared,
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


def decode(data: bytes) -> tuple[dict[str, TensorSpec], ColumnRanks, bool, int]:
    """(tensors, ranks, allow_casts, receive_window) of a layout from `encode`'s bytes, checked for consistency:
    LayoutError on malformed input. (Whether the layout is valid is the validator's check.)"""
    import json
    import zlib

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
        undeclared = [str(n) for n in h.get("undeclared", [])]
        _check_wire(cols, nb, npc, w, len(tensors), len(undeclared), len(names), rank_class)
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
        window = int(h.get("receive_window", 0))
        if window < 0:
            raise ValueError(f"receive_window {window} is negative")
        return (tensors, ColumnRanks(sorted(tensors), names, classes, rank_class, undeclared), bool(h.get("allow_casts", False)),
                window)
    except LayoutError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, zlib.error, UnicodeDecodeError, RecursionError,
            OverflowError) as e:  # RecursionError: a header nested thousands deep
        raise LayoutError(f"malformed layout: {type(e).__name__}: {str(e)[:200]}") from None


def _check_wire(cols: dict, nb: list[int], npc: list[int], w: int, ntensors: int, nundeclared: int, nnames: int,
                rank_class: list[int]) -> None:
    B, P = sum(nb), sum(npc)
    for f in _BUF_FIELDS + _PIECE_FIELDS:
        want = (B if f in _BUF_FIELDS else P,) + ((w,) if f in _WIDE else ())
        if cols.get(f) is None or cols[f].shape != want:
            raise ValueError(f"array {f!r} has shape {None if cols.get(f) is None else cols[f].shape}, not {want}")
    if any(c < 0 or c >= len(nb) for c in rank_class) or any(x < 0 for x in nb + npc):
        raise ValueError("class indexes out of range")
    if B and (cols["buf_name"].min() < 0 or cols["buf_name"].max() >= nnames):
        raise ValueError("buffer name ids out of range")
    if P and (cols["p_tensor"].min() < -1 - nundeclared or cols["p_tensor"].max() >= ntensors):
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
