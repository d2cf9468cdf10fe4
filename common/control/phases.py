"""The phases of an update, one name each (status, logs, fault injection, the proto's strings).

    WAITING -> NEGOTIATE -> CONNECT -> TRANSFER -> VERIFY -> COMMIT -> DONE, or ABORT from any

WAITING: workers asked for are not attached yet. STEP: standalone trainer workers take their
simulated optimizer step. IDLE: no update yet. A Phase is a str: it compares equal to its
name, and goes into protobuf string fields as is."""

from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    IDLE = "IDLE"
    WAITING = "WAITING"
    STEP = "STEP"
    NEGOTIATE = "NEGOTIATE"
    CONNECT = "CONNECT"
    TRANSFER = "TRANSFER"
    VERIFY = "VERIFY"
    COMMIT = "COMMIT"
    DONE = "DONE"
    ABORT = "ABORT"

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({Phase.DONE, Phase.ABORT})
"""An update in one of these has ended."""
AT_REST = frozenset({Phase.IDLE, Phase.DONE, Phase.ABORT})
"""No update in progress."""
FINISHING = frozenset({Phase.VERIFY, Phase.COMMIT})
"""Inference's FinishUpdate owns the update: nothing else may abort it."""
