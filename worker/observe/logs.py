"""Structured logs: one JSON object per line, for log pipelines (DIFFQ_LOG_JSON=true)."""

from __future__ import annotations

import json
import logging
import time

# Attributes every LogRecord has; anything else was passed as `extra=` and is kept.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """ts, level, logger, msg, plus `extra=` fields; a message that is itself a JSON
    object (the worker's per-batch line) is merged in rather than double-encoded."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        entry: dict = {"ts": round(record.created, 3),
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                       "level": record.levelname, "logger": record.name}
        fields = None
        if message.startswith("{"):
            try:
                fields = json.loads(message)
            except ValueError:
                pass
        if isinstance(fields, dict):
            entry.update(fields)
        else:
            entry["msg"] = message
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def install_json_logging(level: str | int = "INFO") -> None:
    """JSON lines on stderr for the root logger (the worker's Celery app keeps them:
    worker/delivery/celery_adapter.py `build_app`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
