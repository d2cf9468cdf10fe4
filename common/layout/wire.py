"""A layout's wire form and fingerprint, as functions over `core.Layout`: the value types do
not depend on their encodings, so the layout package has no import cycle.

The wire form is columns, not pieces (`columns.encode`): made once per layout and kept in
its memo, as is the fingerprint (a digest of the content: equal layouts, however built or
encoded, share it). `layout_from_bytes` also reads a layout's JSON (`Layout.to_json`)."""

from __future__ import annotations

import json

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
        return decode(data)
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise LayoutError(f"malformed layout: {e}") from e
    return Layout.from_json(obj)


def layout_fingerprint(layout: Layout) -> str:
    fp = layout._memo.get("fingerprint")
    if fp is None:
        table = build_table(layout, {}, require_full_buffers=False, check=False)
        fp = layout._memo["fingerprint"] = table.fingerprint()[:16]
    return fp
