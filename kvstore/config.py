"""Configuration: one frozen dataclass per component, composed by the daemon.

Every field has a default that works with no config file. `ServerConfig.from_dict`
takes the parsed TOML and rejects unknown keys and bad values with a message that
names the key: a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, is_dataclass, replace

from kvstore.errors import InvalidArgument

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str) -> int:
    """`4096`, `"64MiB"`, `"1.5GiB"`, `"2GB"` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgument(f"size must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if match is None:
        raise InvalidArgument(f"cannot parse size {value!r}; use bytes or e.g. '64MiB', '2GiB'")
    unit = match.group(2).lower() if match.group(2) else None
    return int(float(match.group(1)) * _UNITS[unit])


def default_runtime_dir() -> str:
    """Where the socket lives by default: $XDG_RUNTIME_DIR/kvstore or /tmp/kvstore-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(base, "kvstore") if base else f"/tmp/kvstore-{os.getuid()}"


def default_socket_path() -> str:
    """$KVSTORE_SOCKET if set, else <runtime dir>/kvstore.sock. Client and daemon agree on it."""
    return os.environ.get("KVSTORE_SOCKET") or os.path.join(default_runtime_dir(), "kvstore.sock")


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "kvstore")


@dataclass(frozen=True, slots=True)
class HostTierConfig:
    # Each namespace gets its own memfd arena of this size (tenants never share memory).
    arena_bytes: int = 1 << 30
    # Fault the arena in at start: first touch runs at ~1 GB/s here against ~10 GB/s.
    prefault: bool = True
    max_namespaces: int = 64
    policy: str = "cost_aware"

    def __post_init__(self) -> None:
        object.__setattr__(self, "arena_bytes", parse_size(self.arena_bytes))
        if self.arena_bytes < 4096 or self.arena_bytes % 4096:
            raise InvalidArgument(f"host.arena_bytes must be a positive multiple of 4096, got {self.arena_bytes}")
        if not isinstance(self.max_namespaces, int) or self.max_namespaces < 1:
            raise InvalidArgument("host.max_namespaces must be an integer >= 1")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_clients: int = 256
    max_leases_per_client: int = 4096
    # A lease not released within this time is taken back (a stuck client cannot pin memory forever).
    lease_ttl_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_clients", "max_leases_per_client"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidArgument(f"limits.{name} must be an integer >= 1")
        if not isinstance(self.lease_ttl_s, (int, float)) or self.lease_ttl_s <= 0:
            raise InvalidArgument("limits.lease_ttl_s must be a number > 0")


@dataclass(frozen=True, slots=True)
class AdminConfig:
    enabled: bool = True
    # Loopback by default: the admin API can delete and evict; expose it deliberately.
    host: str = "127.0.0.1"
    port: int = 8470  # 0 picks a free port (written to <data_dir>/admin.addr)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidArgument(f"admin.port must be 0..65535, got {self.port!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    data_dir: str = field(default_factory=default_data_dir)
    socket_path: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o600
    # Recompute the xxh3-128 of every put in the daemon and refuse a mismatch.
    verify_puts: bool = True
    log_level: str = "info"
    log_format: str = "kv"
    host: HostTierConfig = HostTierConfig()
    limits: LimitsConfig = LimitsConfig()
    admin: AdminConfig = AdminConfig()

    def __post_init__(self) -> None:
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise InvalidArgument(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.log_format not in ("kv", "json"):
            raise InvalidArgument(f"log_format must be kv or json, got {self.log_format!r}")
        if len(os.fsencode(self.socket_path)) > 100:
            raise InvalidArgument(f"socket_path is too long for a Unix socket (max ~100 bytes): {self.socket_path}")

    @classmethod
    def from_dict(cls, data: dict) -> ServerConfig:
        return _build(cls, data, "")

    def with_overrides(self, **changes) -> ServerConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise InvalidArgument(f"config section {prefix or '<top>'} must be a table")
    known = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise InvalidArgument(
            f"unknown config key(s) {sorted(prefix + k for k in unknown)}; known: {sorted(known)}"
        )
    values = {}
    for name, value in data.items():
        default = getattr(cls(), name) if not is_dataclass(known[name].default) else known[name].default
        if is_dataclass(default):
            values[name] = _build(type(default), value, f"{prefix}{name}.")
        else:
            values[name] = value
    try:
        return cls(**values)
    except TypeError as exc:
        raise InvalidArgument(f"bad config in {prefix or '<top>'}: {exc}") from None
