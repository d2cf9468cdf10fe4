"""Verification on the control plane, in compact arrays keyed by the plan's digest.

After a transfer every source rank reports its sums per destination piece as (slot, value)
pairs (`sender_report`); the trainer controller adds them into one array over the plan's slots
(`merge_reports`), sends it to the inference controller in FinishUpdate, which hands each rank
the values of the pieces it verifies, in that rank's order (`rank_expected`); the rank checks
what it holds against them (`check_rank`). Slots are derived from the plan on every end
(`Plan.checksum_keys`, `Plan.verify_pieces`), so only numbers travel: 8 bytes per piece a source
sent, 4 per slot, 4 per piece verified. A DeepSeek-V3 update's largest message is a few MB
where one (rank, buffer name, piece, value) record per piece made it over 256 MiB."""

from __future__ import annotations

import numpy as np
import torch

from reshard.common.dataplane.checksum import P, box_checksum, box_checksums
from reshard.common.layout.core import LayoutError
from reshard.common.plan.planner import Plan
from reshard.proto import reshard_pb2 as pb

_U32 = np.dtype("<u4")


def _array(b: bytes, what: str) -> np.ndarray:
    if len(b) % 4:
        raise LayoutError(f"{what}: {len(b)} bytes is not a whole number of uint32 values")
    return np.frombuffer(b, dtype=_U32)


def _check_digest(plan: Plan, c: pb.Checksums, what: str) -> None:
    if c.plan_digest != plan.digest:
        raise LayoutError(f"{what} are for plan {c.plan_digest or '(none)'}, this update's plan is {plan.digest}")


def sender_report(plan: Plan, sums: dict[tuple[int, str, int], int], strict: bool = True) -> pb.Checksums:
    """A source rank's sums ((dst rank, buffer, piece) -> value) as (slot, value) pairs."""
    return report(plan, *plan.checksum_slots(sums, strict))


def report(plan: Plan, slots: np.ndarray, values: np.ndarray) -> pb.Checksums:
    return pb.Checksums(plan_digest=plan.digest, slots=np.ascontiguousarray(slots, dtype=_U32).tobytes(),
                        values=np.ascontiguousarray(values, dtype=_U32).tobytes())


def merge_reports(plan: Plan, reports: list[pb.Checksums]) -> np.ndarray:
    """Every source's report added into one array over the plan's slots (uint32, mod 2**32)."""
    n = plan.num_checksum_slots
    total = np.zeros(n, dtype=np.uint64)
    for c in reports:
        _check_digest(plan, c, "source checksums")
        slots, values = _array(c.slots, "checksum slots"), _array(c.values, "checksum values")
        if len(slots) != len(values):
            raise LayoutError(f"source checksums: {len(slots)} slots for {len(values)} values")
        if len(slots) and int(slots.max()) >= n:
            raise LayoutError(f"source checksums: slot {int(slots.max())} outside the plan's {n}")
        np.add.at(total, slots.astype(np.int64), values.astype(np.uint64))  # fewer than 2**32 values below 2**32 each
    return (total % P).astype(_U32)


def dense(plan: Plan, values: np.ndarray) -> pb.Checksums:
    return pb.Checksums(plan_digest=plan.digest, values=np.ascontiguousarray(values, dtype=_U32).tobytes())


def slot_values(plan: Plan, c: pb.Checksums) -> np.ndarray:
    """The dense array of a FinishUpdate, checked against the plan."""
    _check_digest(plan, c, "expected checksums")
    values = _array(c.values, "expected checksums")
    if c.slots or len(values) != plan.num_checksum_slots:
        raise LayoutError(f"expected checksums: {len(values)} values for the plan's {plan.num_checksum_slots} slots")
    return values


def rank_expected(plan: Plan, rank: int, values: np.ndarray) -> pb.Checksums:
    """What destination `rank` must find, one value per piece it verifies, in its order."""
    _, slots = plan.verify_pieces(rank)
    got = np.where(slots >= 0, values[np.maximum(slots, 0)] if len(values) else 0, 0)
    return dense(plan, got)


def check_rank(plan: Plan, rank: int, expected: pb.Checksums, buffers: dict[str, torch.Tensor], pieces, shapes,
               checksum=box_checksum, landed: dict | None = None) -> None:
    """Checksum every piece `rank` verifies and compare, in order. `pieces`: (buffer, index) ->
    Piece of this rank's layout. `landed`: (rank, buffer, index) -> the sum the engine took of
    each piece's segments where they landed, during the transfer (`Engine(receiver_sums=True)`);
    a piece not in it (one that came inside a whole-buffer relay) is read now: with the default
    `checksum`, on a GPU all such pieces are queued (a large one in tiles) and read back at once.
    Raises LayoutError on the first piece that differs, naming its tensor and box."""
    _check_digest(plan, expected, "expected checksums")
    keys, _ = plan.verify_pieces(rank)
    want = _array(expected.values, "expected checksums")
    if len(want) != len(keys):
        raise LayoutError(f"rank {rank}: {len(want)} expected checksums for its {len(keys)} pieces")
    rows, missing = [], None  # (buffer, index, piece, expected, the landed sum or None), in order
    for (bname, i), w in zip(keys, want.tolist()):
        piece = pieces.get((bname, i))
        if piece is None:
            missing = LayoutError(f"rank {rank}: the plan verifies buffer {bname!r} piece {i}, which this rank does not hold")
            break
        rows.append((bname, i, piece, w, landed.get((rank, bname, i)) if landed else None))
    todo = [r for r in rows if r[4] is None]
    boxes = [(piece.view(buffers[bname]), piece.box.offset, shapes[piece.tensor]) for bname, _, piece, _, _ in todo]
    read = iter(box_checksums(boxes) if checksum is box_checksum else [checksum(*b) for b in boxes])
    for bname, _, piece, w, got in rows:
        if got is None:
            got = next(read)
        if got != w % P:
            raise LayoutError(f"checksum mismatch on inference rank {rank}: tensor {piece.tensor!r} box {piece.box} "
                              f"in buffer {bname!r} (expected {w}, got {got})")
    if missing is not None:
        raise missing
