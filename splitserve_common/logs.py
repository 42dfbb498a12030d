"""Structured logs: one JSON object per line (ts, level, logger, msg, request_id, then any extra fields).

The request id lives in a context variable that the ops middleware sets for each HTTP request, so any
log call made while serving that request (handlers, stream generators, the gateway's engine hops)
carries it without threading it through every function.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
from typing import Any

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime",
                                                                                 "color_message", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None) or request_id_var.get(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        # default=str: a field that is not JSON (a Path, an exception) must not lose the line.
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The human format, with the request id when there is one."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None) or request_id_var.get()
        return f"{line} [request_id={rid}]" if rid else line


def configure_logging(level: str = "info", log_format: str = "text") -> None:
    """Root logger to stderr in the chosen format; uvicorn's loggers propagate into it."""
    if log_format not in ("json", "text"):
        raise ValueError(f"unknown log format {log_format!r} (json or text)")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
    # One line per engine hop at info would double the gateway's log volume; the access line says enough.
    logging.getLogger("httpx").setLevel(max(root.level, logging.WARNING))

