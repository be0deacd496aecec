"""Logging for every batchserve process: one line per record on stderr, as text or as JSON.

`setup_logging(log_format)` installs the handler on the root logger (idempotent). Structured
fields travel in `extra={"fields": {...}}`; `log_event(logger, event, **fields)` is the short way:

    log_event(logging.getLogger("batchserve.requests"), "request", rid="cmpl-1", prompt_tokens=5)

text: `2026-01-01T00:00:00.123Z INFO batchserve.requests request rid=cmpl-1 prompt_tokens=5`
json: `{"time": "2026-01-01T00:00:00.123Z", "level": "INFO", "logger": "batchserve.requests",
        "message": "request", "rid": "cmpl-1", "prompt_tokens": 5}`
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]
FIELDS_ATTR = "fields"  # the LogRecord attribute that carries structured fields

_json_encoder = msgspec.json.Encoder()


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _record_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS_ATTR, None)
    return fields if isinstance(fields, dict) else {}


def _text_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    # Quote values a key=value reader would split on, so that every line stays parseable.
    if text == "" or any(c in text for c in ' ="\n\t'):
        return _json_encoder.encode(text).decode()
    return text


class TextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER MESSAGE key=value ...` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, record.name, record.getMessage()]
        parts += [f"{key}={_text_value(value)}" for key, value in _record_fields(record).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _record_fields(record).items():
            obj.setdefault(key, value)
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        # Values msgspec cannot encode (a stray object) are logged as their str() rather than lost.
        return msgspec.json.encode(obj, enc_hook=str).decode()


def make_formatter(log_format: LogFormat) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {log_format!r} (expected 'text' or 'json')")


class _BatchserveHandler(logging.StreamHandler):
    """Marks the handler `setup_logging` owns, so a second call replaces it instead of adding one."""


def setup_logging(log_format: LogFormat = "text", level: int = logging.INFO) -> None:
    """Send every logger's records to stderr in `log_format`, one line each."""
    formatter = make_formatter(log_format)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _BatchserveHandler):
            root.removeHandler(handler)
    handler = _BatchserveHandler(sys.stderr)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log `event` with structured `fields` (rendered key=value in text, as keys in JSON)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={FIELDS_ATTR: fields})
