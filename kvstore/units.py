"""Sizes, durations and addresses as the config, the command line and the APIs take them:
`parse_size("64MiB")`, `check_seconds(60, "ttl_s")`, `parse_address("10.0.0.2:8471")`; errors
name the key or field they came from."""

from __future__ import annotations

import re

from kvstore.errors import InvalidArgument

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str, key: str = "size") -> int:
    """`4096`, `"64MiB"`, `"1.5GiB"`, `"2GB"` -> bytes; errors name `key` (e.g. "host.arena_bytes")."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgument(f"{key} must be >= 0 bytes, got {value}")
        return value
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise InvalidArgument(f"{key} must be a size in bytes or e.g. '64MiB', '2GiB', got {value!r}")
    unit = match.group(2).lower() if match.group(2) else None
    return int(float(match.group(1)) * _UNITS[unit])


# The longest duration a TTL, a pin or a hint may name: a century. Longer means "never" (leave
# the TTL out); the bound keeps every deadline (now + ttl) a finite float and every value one
# that msgpack carries (its integers end at 2**64).
MAX_DURATION_S = 100 * 365 * 24 * 3600


def check_seconds(value, name: str, maximum: float = MAX_DURATION_S, unit: str = "seconds"):
    """`value` unchanged when it is a number of `unit` in 0..maximum (an int or a float),
    else InvalidArgument naming `name` and the range: NaN, infinities, bools and integers
    too large for a float are refused here, so nothing past this check can overflow. The
    one rule for TTLs and durations: Hints, the wire's pin TTL, the client, the admin API."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= maximum:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InvalidArgument(f"{name} must be a number of {unit} in 0..{maximum:,}, got {shown}")
    return value


def parse_address(value: str, any_port: bool = False) -> tuple[str, int]:
    """`"10.0.0.2:8471"` or `"[::1]:8471"` -> (host, port); `any_port` admits port 0 (listen only)."""
    host, sep, port = str(value).rpartition(":")
    host = host.strip("[]")
    low = 0 if any_port else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) <= 65535:
        raise InvalidArgument(f"address must be host:port with a port in {low}..65535, got {value!r}")
    return host, int(port)
