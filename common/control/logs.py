"""Logs as text (the default) or JSON (`--log-format json`, RESHARD_LOG_FORMAT=json): one object
per line with `time`, `level`, `logger`, `message`, the process's `role` and, on every line logged
while an update is in flight in that task, its `update_id`, `version` and `deployment`.

The update's fields come from a context variable set where an update is handled (the trainer's
update loop, inference's BeginUpdate / FinishUpdate / AbortUpdate, a worker's transfer), so
asyncio tasks and the threads they start with `contextvars` carry them. Only the processes
reshard starts configure logging (the CLI, the standalone workers); a library embedded in a
trainer or an engine never touches its host's logging."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time

FORMATS = ("text", "json")
_UPDATE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("reshard_update", default=None)


def set_update(update_id: str, version=None, deployment: str = "") -> None:
    """Every log line of the current task from here on says which update it belongs to (a gRPC
    handler's task ends with the call, and the fields with it; tasks it starts inherit them)."""
    fields = {"update_id": update_id}
    if version is not None and (version.run or version.step):
        fields["version"] = f"{version.run}:{version.step}"
    if deployment:
        fields["deployment"] = deployment
    _UPDATE.set(fields)


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str = "") -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.role:
            out["role"] = self.role
        out.update(_UPDATE.get() or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str, fmt: str = "", text_format: str = "%(asctime)s %(name)s %(levelname)s %(message)s",
              role: str = "") -> None:
    """The logging of a process reshard starts: `fmt` text or json (default RESHARD_LOG_FORMAT, else text)."""
    fmt = fmt or os.environ.get("RESHARD_LOG_FORMAT", "text") or "text"
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} (--log-format, or RESHARD_LOG_FORMAT) must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=level.upper(), handlers=[handler])
