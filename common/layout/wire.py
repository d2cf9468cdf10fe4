"""A layout's wire form and fingerprint, as functions over `core.Layout`: the value types do
not depend on their encodings, so the layout package has no import cycle.

The wire form is columns, not pieces (`columns.encode`): made once per layout and kept in
its memo, as is the fingerprint (a digest of the content: equal layouts, however built or
encoded, share it). There is no other encoding: anything else is refused as malformed."""

from __future__ import annotations

from reshard.common.layout.columns import decode, encode
from reshard.common.layout.core import Layout, LayoutError
from reshard.common.layout.tables import build_table


def layout_bytes(layout: Layout) -> bytes:
    data = layout._memo.get("bytes")
    if data is None:
        data = layout._memo["bytes"] = encode(layout)
    return data


def layout_from_bytes(data: bytes) -> Layout:
    if data[:3] == b"RSL":  # the wire form (an older one is refused by name)
        tensors, ranks, allow_casts, window = decode(data)
        return Layout(tensors, ranks, allow_casts, window)
    raise LayoutError(f"malformed layout: not a layout's wire form (starts {bytes(data[:8])!r})")


def layout_fingerprint(layout: Layout) -> str:
    fp = layout._memo.get("fingerprint")
    if fp is None:
        table = build_table(layout, {}, require_full_buffers=False, check=False)
        fp = layout._memo["fingerprint"] = table.fingerprint()[:16]
    return fp
