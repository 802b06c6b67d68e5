"""Structured logs: key=value (default) or JSON lines, one line per event."""

from __future__ import annotations

import json
import logging
import re
import sys
import time

# A string value that needs no quotes: nothing that could end the value or start another
# key=value (whitespace, "=", a quote, a backslash) and no control character.
_PLAIN = re.compile(r'[^\s="\\\x00-\x1f\x7f]*\Z')
# One key=value of a message: the value plain, or a JSON string (what message() quotes).
_PAIR = re.compile(r'([A-Za-z_][\w.]*)=("(?:[^"\\]|\\.)*"|\S*)')


# The conversions of a %-format string, in order (%% converts nothing).
_CONVERSION = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])")


def message(record: logging.LogRecord) -> str:
    """The record's message with every string argument shown by %s that is not plain quoted
    as a JSON string (%r already quotes): messages carry client-chosen strings (names,
    namespaces), and one such as 'y level=error' or one with a newline must not forge a
    field or a line."""
    args = record.args
    if isinstance(args, tuple) and args and isinstance(record.msg, str):
        shown = [c for c in _CONVERSION.findall(record.msg) if c != "%"]
        if len(shown) == len(args):
            args = tuple(json.dumps(a) if c == "s" and isinstance(a, str) and not _PLAIN.match(a) else a
                         for c, a in zip(shown, args))
        text = record.msg % args
    else:
        text = record.getMessage()
    return text.replace("\r", "\\r").replace("\n", "\\n")


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        message_ = message(record)
        line = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} logger={record.name} {message_}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name}
        text = message(record)
        pairs = list(_PAIR.finditer(text))
        for match in pairs:
            key, value = match.group(1), match.group(2)
            if key not in ("ts", "level", "logger"):  # the record's own fields are not the message's to set
                doc[key] = json.loads(value) if value.startswith('"') else value
        rest = _PAIR.sub("", text).split()
        if rest:
            doc["msg"] = " ".join(rest)
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
