"""Structured logs: key=value (default) or JSON lines, one line per event."""

from __future__ import annotations

import json
import logging
import sys
import time


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        # Messages carry client-chosen strings (names, namespaces): a newline in one must not
        # start a forged log line.
        message = record.getMessage().replace("\r", "\\r").replace("\n", "\\n")
        line = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} logger={record.name} {message}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name}
        for part in record.getMessage().split(" "):
            key, sep, value = part.partition("=")
            if sep:
                doc[key] = value
            else:
                doc.setdefault("msg", "")
                doc["msg"] = (doc["msg"] + " " + part).strip()
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure(level: str = "info", fmt: str = "kv") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _KeyValueFormatter())
    root = logging.getLogger("kvstore")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
