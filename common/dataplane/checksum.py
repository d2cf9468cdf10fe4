"""Position-aware checksum of tensor boxes, combinable across pieces, mod 2**32.

A tensor of `shape` is seen as rows (every leading dim flattened: global row index R)
of bytes (the last dim times the element size, in memory order: global byte column g).
Bytes are grouped into 32-bit little-endian words at their *global* positions (word
j = g // 4, lane g % 4), and

    checksum = sum_{R, g} byte[R, g] * 2**(8 * (g % 4)) * wc[g // 4] * wr[R]   mod 2**32

with odd hashed weights wc (of the global word) and wr (of the global row), both below
2**31. Over whole words the inner sum is each word times its weight: one 32-bit
matrix-vector product over the data, read once, with the partial words at a box's two
edges done byte by byte. On the host it is torch's int32 product where the words are
aligned (about 1.7x numpy's on one core; each process checks once that it wraps mod
2**32), else numpy's unsigned one (whose arithmetic wraps by definition). Checksums of disjoint boxes add up (mod 2**32) to the checksum of their union,
so a sender can checksum the segments it sends and a receiver the piece it holds, and
they agree when every byte arrived at its position. Odd weights make any change of a
single word visible; swapped rows, swapped words and misplaced interleaves change it.

`box_checksum_torch` computes the same number with torch integer ops on the tensor's
own device (no copy to the host); `box_checksum_tensor` leaves it there, queued on the
current stream, and nothing in it makes the host wait for the stream.

Cost. A box is summed in tiles of at most `chunk_words` words (rows of it, or blocks of
one row's words when a row is longer): a tile's int64 temporaries are 8 bytes per word of
the tile whatever the box's size, and a large piece is one device scalar accumulated tile
by tile. Per tile on a device: the words (a view of the data where it is 32-bit aligned; else
copied once into zero-padded words, which also places a box's partial edge words in their
lanes) times their column weights in one op (int32 by int64), masked, summed per row; then
the row sums masked, times their row weights, masked, summed: seven ops, one more per box.
Weights of global rows and words below `TABLE_ENTRIES` are computed once per device (two
growing tables) and then read as slices: no hashing per box. Both paths keep every product
below 2**63, so no int64 op ever overflows."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from reshard.common.dataplane.mixing import mix31

P = 1 << 32  # the modulus: checksums are uint32 values
_MASK = P - 1
_COL_SALT, _ROW_SALT = 0x1B873593, 0x2545F491

CHUNK_WORDS = 1 << 21  # words per tile on a device: 16 MiB of int64 products (the default bucket)
HOST_CHUNK_WORDS = 1 << 16  # the torch path on the host (tests, the bench): tiles that stay in the CPU's caches
NUMPY_CHUNK_WORDS = 1 << 21  # the numpy path: its temporaries are per row of a tile, a few bytes per row
TABLE_ENTRIES = 1 << 20  # weights of global rows and words below this come from a table made once per device


def _chunk(device: torch.device, chunk_words: int | None) -> int:
    n = chunk_words if chunk_words is not None else (HOST_CHUNK_WORDS if device.type == "cpu" else CHUNK_WORDS)
    if n < 1:
        raise ValueError(f"chunk_words must be at least 1, got {n}")
    return n


def _hashed(x: torch.Tensor) -> torch.Tensor:
    """Odd weights (int64, below 2**31) of salted global indices."""
    return mix31(x).bitwise_or_(1)


class _Tables:
    """Weights of global indices 0 .. n - 1 per (device, salt), made once and grown by doubling up to
    TABLE_ENTRIES. On a GPU a table is made on a stream of its own and that stream is waited for
    (only its own few kernels, never the caller's queued work), so any stream may read it at once;
    a table outgrown is kept, as kernels queued on other streams may still read it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t: dict[tuple, torch.Tensor] = {}
        self._host: dict[tuple, torch.Tensor] = {}  # the CPU tables as int32 (the host path's column weights)
        self._kept: list[torch.Tensor] = []

    def get(self, salt: int, n: int, device: torch.device) -> torch.Tensor | None:
        """A table covering indices 0 .. n - 1 (int64 on `device`), or None past TABLE_ENTRIES."""
        if n > TABLE_ENTRIES:
            return None
        key = (device.type, device.index, salt)
        t = self._t.get(key)
        if t is not None and t.numel() >= n:
            return t
        with self._lock:
            t = self._t.get(key)
            if t is None or t.numel() < n:
                size = min(TABLE_ENTRIES, max(4096, 1 << (n - 1).bit_length()))
                if t is not None and device.type != "cpu":
                    self._kept.append(t)
                t = self._t[key] = self._make(salt, size, device)
                self._host.pop(key, None)
        return t

    def host_i32(self, salt: int, n: int) -> torch.Tensor | None:
        """The CPU table as int32 (every weight is below 2**31): the host path's column weights."""
        t = self.get(salt, n, torch.device("cpu"))
        if t is None:
            return None
        key = ("cpu", None, salt)
        h = self._host.get(key)
        if h is None or h.numel() < t.numel():
            h = self._host[key] = t.to(torch.int32)
        return h

    @staticmethod
    def _make(salt: int, n: int, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return _hashed(torch.arange(salt, salt + n, dtype=torch.int64, device=device))
        side = torch.cuda.Stream(device=device)
        with torch.cuda.stream(side):
            t = _hashed(torch.arange(salt, salt + n, dtype=torch.int64, device=device))
        side.synchronize()  # made before any stream reads it
        return t


_TABLES = _Tables()


def _lead_strides(lead_shape: tuple[int, ...]) -> tuple[int, ...]:
    out, s = [], 1
    for d in reversed(lead_shape):
        out.append(s)
        s *= d
    return tuple(reversed(out))


class _Rows:
    """Global row indices of a row view's rows: base + sum_d (off_d + i_d) * stride_d, with i the
    row's index in the box's leading dims (row-major). Leading dims of size 1 fold into base."""

    def __init__(self, base: int, off: tuple[int, ...], size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        keep = [d for d in range(len(size)) if size[d] != 1]
        self.base = base + sum(off[d] * stride[d] for d in range(len(size)) if size[d] == 1)
        self.off = tuple(off[d] for d in keep)
        self.size = tuple(size[d] for d in keep)
        self.stride = tuple(stride[d] for d in keep)
        self.count = 1
        for s in self.size:
            self.count *= s
        # Evenly spaced global rows (step: the last dim's stride; 1 when every inner dim is whole) when
        # each inner dim's size times its stride is the stride of the dim around it.
        self.contiguous = all(self.size[d] * self.stride[d] == self.stride[d - 1] for d in range(1, len(self.size)))
        self.first = self.base + sum(o * s for o, s in zip(self.off, self.stride))  # global row of local row 0
        self.last = self.base + sum((o + n - 1) * s for o, n, s in zip(self.off, self.size, self.stride))

    def ids(self, r0: int, r1: int, device: torch.device) -> torch.Tensor:
        """Global rows of local rows r0 .. r1 - 1 (int64 on `device`)."""
        if self.contiguous:
            st = self.stride[-1] if self.stride else 1
            return torch.arange(self.first + r0 * st, self.first + r1 * st, st, dtype=torch.int64, device=device)
        i = torch.arange(r0, r1, dtype=torch.int64, device=device)
        g = torch.full_like(i, self.base)
        for d in reversed(range(len(self.size))):
            if d:
                q = torch.div(i, self.size[d], rounding_mode="floor")
                g += (i - q * self.size[d] + self.off[d]) * self.stride[d]
                i = q
            else:
                g += (i + self.off[d]) * self.stride[d]
        return g

    def ids_np(self, r0: int, r1: int) -> np.ndarray:
        if self.contiguous:
            st = self.stride[-1] if self.stride else 1
            return np.arange(self.first + r0 * st, self.first + r1 * st, st, dtype=np.int64)
        i = np.arange(r0, r1, dtype=np.int64)
        g = np.full_like(i, self.base)
        for d in reversed(range(len(self.size))):
            if d:
                i, m = np.divmod(i, self.size[d])
                g += (m + self.off[d]) * self.stride[d]
            else:
                g += (i + self.off[d]) * self.stride[d]
        return g

    def weights(self, r0: int, r1: int, device: torch.device) -> torch.Tensor:
        """Row weights (int64) of local rows r0 .. r1 - 1: a slice or a gather of the device's table."""
        table = _TABLES.get(_ROW_SALT, self.last + 1, device)
        if table is None:
            return _hashed(self.ids(r0, r1, device) + _ROW_SALT)
        if self.contiguous and (not self.stride or self.stride[-1] == 1):
            return table[self.first + r0 : self.first + r1]
        return table[self.ids(r0, r1, device)]

    def weights_np(self, r0: int, r1: int) -> np.ndarray:
        """Row weights as uint64, for the numpy path."""
        table = _TABLES.get(_ROW_SALT, self.last + 1, torch.device("cpu"))
        if table is None:
            return _hashed(torch.from_numpy(self.ids_np(r0, r1)) + _ROW_SALT).numpy().view(np.uint64)
        t = table.numpy().view(np.uint64)
        if self.contiguous and (not self.stride or self.stride[-1] == 1):
            return t[self.first + r0 : self.first + r1]
        return t[self.ids_np(r0, r1)]


def _col_weights(j0: int, j1: int, device: torch.device) -> torch.Tensor:
    table = _TABLES.get(_COL_SALT, j1, device)
    if table is None:
        return _hashed(torch.arange(j0 + _COL_SALT, j1 + _COL_SALT, dtype=torch.int64, device=device))
    return table[j0:j1]


def _col_weights_i32(j0: int, j1: int) -> torch.Tensor:
    """Column weights on the host as int32 (never written: the numpy path reads them as uint32)."""
    table = _TABLES.host_i32(_COL_SALT, j1)
    if table is None:
        return _hashed(torch.arange(j0 + _COL_SALT, j1 + _COL_SALT, dtype=torch.int64)).to(torch.int32)
    return table[j0:j1]


def _col_weights_u32(j0: int, j1: int) -> np.ndarray:
    return _col_weights_i32(j0, j1).numpy().view(np.uint32)


def _normalized(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]):
    """A box of at least two dims: a scalar is one element of row 0, a vector is row 0."""
    if values.dim() == 0:
        values, offset, shape = values.reshape(1), (0,), (1,)
    if values.dim() == 1:
        values, offset, shape = values.unsqueeze(0), (0, *offset), (1, *shape)
    return values, tuple(offset), tuple(shape)


def _row_views(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...], base: int,
               slab_bytes: int) -> Iterator[tuple[torch.Tensor, _Rows]]:
    """The box as 2-D views of rows (each with its global rows), copying nothing larger than
    `slab_bytes`: leading dims that do not merge into one (a box cut in an inner leading dim) are
    taken in slabs of the outer dim, copied to merge when small, else one index at a time."""
    ncols = values.shape[-1]
    strides = _lead_strides(shape[:-1])
    try:
        rows = values.view(-1, ncols)
    except RuntimeError:
        rows = None
    if rows is not None:
        yield rows, _Rows(base, offset[:-1], tuple(values.shape[:-1]), strides)
        return
    per = values[0].numel() * values.element_size()
    if per <= slab_bytes:
        k = max(1, slab_bytes // per)
        for i0 in range(0, values.shape[0], k):
            slab = values[i0 : i0 + k].contiguous()
            yield slab.view(-1, ncols), _Rows(base, (offset[0] + i0, *offset[1:-1]), tuple(slab.shape[:-1]), strides)
        return
    inner = strides[0]  # global rows per index of the outer dim
    for i in range(values.shape[0]):
        yield from _row_views(values[i], offset[1:], shape[1:], base + (offset[0] + i) * inner, slab_bytes)


def _blocks(nrows: int, b0: int, nbytes: int, esize: int, chunk: int):
    """Tiles of a row view whose first byte is at global byte column b0: (r0, r1, blocks), each
    block (j0, j1, e0, e1, skip, lane0, nb): global words j0 .. j1 - 1, held by elements e0 .. e1 - 1
    of each row, whose bytes from `skip` on (nb of them) sit in those words from lane `lane0` on."""
    b1 = b0 + nbytes
    w0, w1 = b0 // 4, -(-b1 // 4)
    width = w1 - w0
    if width <= chunk:
        step, spans = max(1, chunk // width), [(w0, w1)]
    else:
        step, spans = 1, [(j, min(w1, j + chunk)) for j in range(w0, w1, chunk)]
    blocks = []
    for j0, j1 in spans:
        g0, g1 = max(b0, 4 * j0), min(b1, 4 * j1)
        e0, e1 = (g0 - b0) // esize, -(-(g1 - b0) // esize)
        blocks.append((j0, j1, e0, e1, g0 - b0 - e0 * esize, g0 - 4 * j0, g1 - g0))
    for r0 in range(0, nrows, step):
        yield r0, min(nrows, r0 + step), blocks


def _tile_bytes(rows: torch.Tensor, r0: int, r1: int, e0: int, e1: int, skip: int, nb: int,
                dtype: torch.dtype | None) -> torch.Tensor:
    """Bytes of a tile (uint8, r1 - r0 rows of nb), as `dtype` where given (cast per tile)."""
    el = rows[r0:r1, e0:e1]
    if dtype is not None and el.dtype != dtype:
        el = el.to(dtype)
    if el.stride(-1) != 1:  # (a strided last dim; or a single column whose stride torch keeps)
        el = el.clone(memory_format=torch.contiguous_format)
    return el.view(torch.uint8)[:, skip : skip + nb]


def _words(by: torch.Tensor, lane0: int, nwords: int) -> torch.Tensor:
    """The tile's global words (int32, rows by nwords): a view where the bytes fill aligned words,
    else one copy into zero-padded words."""
    r, nb = by.shape
    if lane0 == 0 and nb == 4 * nwords and by.data_ptr() % 4 == 0 and by.storage_offset() % 4 == 0:
        if r == 1:
            return by[0].view(torch.int32).unsqueeze(0)
        if by.stride(0) % 4 == 0:
            return by.view(torch.int32)
    partial = lane0 or nb != 4 * nwords
    pad = (torch.zeros if partial else torch.empty)((r, 4 * nwords), dtype=torch.uint8, device=by.device)
    pad[:, lane0 : lane0 + nb].copy_(by)
    return pad.view(torch.int32)


def _on_host(values: torch.Tensor) -> bool:
    return values.device.type == "cpu"


def box_checksum(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...],
                 dtype: torch.dtype | None = None) -> int:
    """Checksum of `values`, the box at `offset` (size values.shape) of a tensor of `shape`, or of
    its values cast to `dtype` where given (the bytes a destination of that dtype holds).
    On a GPU it runs there (`box_checksum_torch`); on the host, one pass over the bytes."""
    if values.numel() == 0:
        return 0
    if not _on_host(values):
        return box_checksum_torch(values, offset, shape, dtype=dtype)
    values, offset, shape = _normalized(values, offset, shape)
    esize = values.element_size() if dtype is None else dtype.itemsize
    chunk = NUMPY_CHUNK_WORDS
    b0, nbytes = offset[-1] * esize, values.shape[-1] * esize
    total = 0
    for rows, ids in _row_views(values, offset, shape, 0, 4 * chunk):
        for r0, r1, blocks in _blocks(rows.shape[0], b0, nbytes, esize, chunk):
            sums = np.zeros(r1 - r0, dtype=np.uint32)  # wraps mod 2**32
            for j0, _j1, e0, e1, skip, _lane0, nb in blocks:
                tb = _tile_bytes(rows, r0, r1, e0, e1, skip, nb, dtype)
                by = tb.numpy()
                g = 4 * j0 + _lane0  # global byte column of by[:, 0]
                head, body, tail = _edges(g, nb)
                if body[1] > body[0]:
                    j = (g + body[0]) // 4
                    sums += _row_sums(tb[:, body[0] : body[1]], j)
                for start, stop in (head, tail):
                    if stop > start:  # a partial word: its bytes in their lanes, times the word's weight
                        part = np.zeros(r1 - r0, dtype=np.uint32)
                        for k in range(start, stop):
                            part += by[:, k].astype(np.uint32) << np.uint32(8 * ((g + k) % 4))
                        j = (g + start) // 4
                        sums += part * _col_weights_u32(j, j + 1)[0]
            tile = (sums.astype(np.uint64) * ids.weights_np(r0, r1)).sum(dtype=np.uint64)  # each product < 2**63
            total = (total + int(tile)) & _MASK  # the sum wraps mod 2**64: still right mod 2**32
    return total


def _torch_mv_wraps() -> bool:
    """Whether torch's int32 matrix-vector product on the host wraps mod 2**32, as the checksum needs:
    checked once per process on products and sums that overflow, against numpy (whose unsigned
    arithmetic wraps by definition). Where it does not, the host path keeps numpy's product."""
    gen = np.random.default_rng(20261207)
    a = gen.integers(0, 1 << 32, size=(3, 257), dtype=np.uint32)
    w = gen.integers(1 << 30, 1 << 31, size=257, dtype=np.uint32) | np.uint32(1)
    try:
        got = torch.mv(torch.from_numpy(a.view(np.int32)), torch.from_numpy(w.view(np.int32))).numpy().view(np.uint32)
    except RuntimeError:
        return False
    return bool(np.array_equal(got, a @ w))


_MV_WRAPS: bool | None = None


def _row_sums(words_bytes: torch.Tensor, j: int) -> np.ndarray:
    """Each row's whole words (uint8 bytes, 4 per word, global words j on) times their column weights,
    summed mod 2**32 (uint32 per row). torch's int32 product where the bytes view as aligned words
    (about 1.7x numpy's on one core), else numpy's over the same bytes."""
    global _MV_WRAPS
    weights = _col_weights_i32(j, j + words_bytes.shape[1] // 4)
    if _MV_WRAPS is None:
        _MV_WRAPS = _torch_mv_wraps()
    if _MV_WRAPS and words_bytes.storage_offset() % 4 == 0 and words_bytes.data_ptr() % 4 == 0 \
            and (words_bytes.shape[0] == 1 or words_bytes.stride(0) % 4 == 0):
        words = words_bytes[0].view(torch.int32).unsqueeze(0) if words_bytes.shape[0] == 1 else words_bytes.view(torch.int32)
        return torch.mv(words, weights).numpy().view(np.uint32)
    return words_bytes.numpy().view(np.uint32) @ weights.numpy().view(np.uint32)


def _edges(b0: int, nbytes: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """The head partial word, the whole words and the tail partial word of global bytes
    [b0, b0 + nbytes), as (start, stop) byte columns relative to b0."""
    b1 = b0 + nbytes
    a0 = min(-(-b0 // 4) * 4, b1)
    a1 = max(b1 // 4 * 4, a0)
    return (0, a0 - b0), (a0 - b0, a1 - b0), (a1 - b0, nbytes)


def box_checksum_torch(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...],
                       dtype: torch.dtype | None = None, chunk_words: int | None = None) -> int:
    """`box_checksum` with torch integer ops on the tensor's device: the same number."""
    return int(box_checksum_tensor(values, offset, shape, dtype=dtype, chunk_words=chunk_words).item())


def box_checksum_tensor(values: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...],
                        dtype: torch.dtype | None = None, chunk_words: int | None = None) -> torch.Tensor:
    """`box_checksum_torch` as a 0-dim int64 tensor on the tensor's device, not read back: queued on
    the current stream, tile by tile (at most `chunk_words` words each, CHUNK_WORDS on a device)."""
    dev = values.device
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=dev)
    chunk = _chunk(dev, chunk_words)
    values, offset, shape = _normalized(values, offset, shape)
    esize = values.element_size() if dtype is None else dtype.itemsize
    b0, nbytes = offset[-1] * esize, values.shape[-1] * esize
    # A tile's sum is below its rows times 2**32, and they add up in `acc`: each is masked first
    # only where the box has rows enough to pass 2**62 (never in practice).
    mask_each = values.numel() // values.shape[-1] >= 1 << 29
    acc = None
    for rows, ids in _row_views(values, offset, shape, 0, 4 * chunk):
        for r0, r1, blocks in _blocks(rows.shape[0], b0, nbytes, esize, chunk):
            sums = None
            for j0, j1, e0, e1, skip, lane0, nb in blocks:
                words = _words(_tile_bytes(rows, r0, r1, e0, e1, skip, nb, dtype), lane0, j1 - j0)
                # int64 products (|word| < 2**31 signed, weight < 2**31), masked: each term < 2**32. One
                # expression, so that a tile's products are freed before the next tile's are made.
                part = (words * _col_weights(j0, j1, dev)).bitwise_and_(_MASK).sum(dim=1)
                sums = part if sums is None else sums.add_(part).bitwise_and_(_MASK)  # a row longer than a tile
            # (sums mod 2**32) * wr < 2**63, then mod 2**32: sums * wr mod 2**32
            tile = sums.bitwise_and_(_MASK).mul_(ids.weights(r0, r1, dev)).bitwise_and_(_MASK).sum()
            if mask_each:
                tile.bitwise_and_(_MASK)
            acc = tile if acc is None else acc.add_(tile)
    return acc.bitwise_and_(_MASK)


def box_checksums(boxes: Iterable[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]) -> list[int]:
    """Checksums of many boxes, in order: on the host one by one; on a device all queued, then
    read back in one copy (one host wait for all of them, not one per box)."""
    out: list[int] = []
    queued: list[tuple[int, torch.Tensor]] = []
    for i, (values, offset, shape) in enumerate(boxes):
        if _on_host(values):
            out.append(box_checksum(values, offset, shape))
        else:
            out.append(0)
            queued.append((i, box_checksum_tensor(values, offset, shape)))
    for (i, _), v in zip(queued, torch.stack([c for _, c in queued]).tolist() if queued else []):
        out[i] = v % P
    return out


def read_sums(queued) -> dict:
    """Sums queued on a device (`box_checksum_tensor`), by key, read back in one copy (mod P).
    `queued`: key -> tensor, or (key, tensor) pairs, several of one key adding up."""
    pairs = list(queued.items()) if isinstance(queued, dict) else list(queued)
    if not pairs:
        return {}
    out: dict = {}
    for (k, _), v in zip(pairs, torch.stack([c for _, c in pairs]).tolist()):
        out[k] = (out.get(k, 0) + v) % P
    return out


def combine(*parts: int) -> int:
    return sum(parts) % P
