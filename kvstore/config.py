"""Configuration: one frozen dataclass per component, composed by the daemon.

Every field has a default that works with no config file. `ServerConfig.from_dict`
takes the parsed TOML and rejects unknown keys, values of the wrong type (checked against
each field's annotation: `enabled = "false"` is a string, not false) and bad values with a
message that names the key: a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass, replace

from kvstore.config_auth import AuthConfig, NamespaceAuth  # noqa: F401 (re-exported)
from kvstore.config_events import EventsConfig
from kvstore.config_remote import RemoteConfig
from kvstore.config_testing import TestingConfig
from kvstore.errors import InvalidArgument
from kvstore.identity import check_name
from kvstore.policy import POLICIES
from kvstore.protocol import MAX_FRAME_BYTES
from kvstore.units import parse_address, parse_size  # noqa: F401 (re-exported: callers read them here)

def _int_in(value, low, high) -> bool:
    """An int (not a bool) in low..high."""
    return type(value) is int and low <= value <= high


def _positive_number(value) -> bool:
    """A finite number > 0 (not a bool, not nan: `nan <= 0` is False)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


# Fields that hold a size: an integer number of bytes or a string such as "64MiB".
SIZE = {"size": True}


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


HUGE_PAGES = ("auto", "off")  # the values of [host] huge_pages (tiers/huge_pages.py)


@dataclass(frozen=True, slots=True)
class HostTierConfig:
    # Each namespace gets its own memfd arena of this size (tenants never share memory).
    arena_bytes: int = field(default=1 << 30, metadata=SIZE)
    # Fault the arena in at start: first touch runs at ~1 GB/s here against ~10 GB/s.
    prefault: bool = True
    max_namespaces: int = 64
    policy: str = "cost_aware"
    # Namespaces whose arenas are made at start, so no client waits for them.
    namespaces: tuple = ("default",)
    # Publish resident objects in a table clients map read-only, so hits need no round trip.
    shared_index: bool = True
    # "auto": arenas on the host's reserved huge pages where enough are free, else on
    # transparent huge pages where shared memory allows them, else 4 KiB pages (logged once);
    # "off": 4 KiB pages (tiers/huge_pages.py).
    huge_pages: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "arena_bytes", parse_size(self.arena_bytes, "host.arena_bytes"))
        if self.arena_bytes < 4096 or self.arena_bytes % 4096:
            raise InvalidArgument(f"host.arena_bytes must be a positive multiple of 4096, got {self.arena_bytes}")
        if not isinstance(self.max_namespaces, int) or not 1 <= self.max_namespaces <= 1 << 16:
            # The NVMe tier's table numbers namespaces in 16 bits (server/tiering/nvme_table.py).
            raise InvalidArgument(f"host.max_namespaces must be an integer from 1 to 65536, got {self.max_namespaces!r}")
        if isinstance(self.namespaces, str) or not isinstance(self.namespaces, (list, tuple)):
            raise InvalidArgument("host.namespaces must be a list of namespace names")
        for name in self.namespaces:
            check_name("host.namespaces: a namespace", name)
        object.__setattr__(self, "namespaces", tuple(self.namespaces))
        if self.policy not in POLICIES:
            raise InvalidArgument(f"host.policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if len(self.namespaces) > self.max_namespaces:
            raise InvalidArgument("host.namespaces lists more namespaces than host.max_namespaces")
        if self.huge_pages not in HUGE_PAGES:
            raise InvalidArgument(f"host.huge_pages must be one of {list(HUGE_PAGES)}, got {self.huge_pages!r}")


WRITE_POLICIES = ("write_back", "write_through", "selective")


# O_DIRECT needs offsets and lengths aligned to the device's logical block; 4 KiB covers every
# device in use (tiers/nvme/files.py uses this value). Capacity and file sizes are multiples of it.
NVME_ALIGN = 4096
NVME_DURABILITIES = ("sync", "group")
# Past a few dozen, more I/O threads only queue at the device; 256 bounds a typo's cost.
MAX_NVME_IO_THREADS = 256
# A group commit that waits longer than 10 s loses more on a crash than any batching gains.
MAX_GROUP_COMMIT_MS = 10_000
# The most hits the host index counts of an object (server/tiering/object_table.py: MAX_HITS, a
# uint16 column): a larger write_after_hits would never be reached.
MAX_WRITE_AFTER_HITS = (1 << 16) - 1


@dataclass(frozen=True, slots=True)
class NvmeTierConfig:
    """The durable tier, the `[nvme]` table; `tiers.nvme.NvmeTier` takes it as is (with `path`
    filled in). Off unless enabled: it preallocates capacity_bytes on disk."""

    enabled: bool = False
    path: str = ""  # "" = <data_dir>/nvme (ServerConfig.nvme_path)
    capacity_bytes: int = field(default=8 << 30, metadata=SIZE)
    file_bytes: int = field(default=1 << 30, metadata=SIZE)
    durability: str = "sync"  # sync: fdatasync + synced index per put; group: every group_commit_ms
    group_commit_ms: float = 5.0
    io_threads: int = 4
    # write_back: objects go to NVMe when the host tier evicts them; write_through: at
    # put (the put returns once durable); selective: once an object has write_after_hits hits.
    write_policy: str = "write_back"
    write_after_hits: int = 2  # at most MAX_WRITE_AFTER_HITS: the hits the host index counts
    # When NVMe is full, a demoted object is admitted only if it was read at least this
    # often recently (TinyLFU-style frequency filter); 0 admits everything.
    admit_min_hits: int = 1
    # On SIGTERM, write every host object that is not on NVMe yet, so a clean restart
    # finds everything (write_back would otherwise lose what never left memory).
    flush_on_shutdown: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise InvalidArgument(f"nvme.path must be a string, got {self.path!r}")
        for name in ("capacity_bytes", "file_bytes"):
            value = parse_size(getattr(self, name), f"nvme.{name}")
            if value <= 0 or value % NVME_ALIGN:
                raise InvalidArgument(f"nvme.{name} must be a positive multiple of {NVME_ALIGN} bytes, got {value}")
            object.__setattr__(self, name, value)
        if self.durability not in NVME_DURABILITIES:
            raise InvalidArgument(f"nvme.durability must be sync or group, got {self.durability!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise InvalidArgument(f"nvme.write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if not _int_in(self.io_threads, 1, MAX_NVME_IO_THREADS):
            raise InvalidArgument(f"nvme.io_threads must be an integer in 1..{MAX_NVME_IO_THREADS}, got {self.io_threads!r}")
        if not _int_in(self.write_after_hits, 1, MAX_WRITE_AFTER_HITS):
            raise InvalidArgument(f"nvme.write_after_hits must be an integer in 1..{MAX_WRITE_AFTER_HITS}, "
                                  f"got {self.write_after_hits!r}")
        if not _int_in(self.admit_min_hits, 0, math.inf):
            raise InvalidArgument(f"nvme.admit_min_hits must be an integer >= 0, got {self.admit_min_hits!r}")
        if not _positive_number(self.group_commit_ms) or self.group_commit_ms > MAX_GROUP_COMMIT_MS:
            raise InvalidArgument(f"nvme.group_commit_ms must be a number in (0, {MAX_GROUP_COMMIT_MS}], "
                                  f"got {self.group_commit_ms!r}")

    def file_sizes(self) -> list[int]:
        """Sizes of the data files: file_bytes each, the last one holds the remainder."""
        full, rest = divmod(self.capacity_bytes, self.file_bytes)
        return [self.file_bytes] * full + ([rest] if rest else [])


# Lowest limits.max_frame_bytes: a lookup of MAX_BATCH ids is a ~140 KiB frame. The highest
# is the protocol's own MAX_FRAME_BYTES, the most any client sends.
MIN_FRAME_BYTES = 256 * 1024
# The least each per-client limit may be, and why: below it the daemon starts but refuses
# what every client needs (limits.max_inflight_bytes_per_client = 1 failed every put).
MIN_LIMITS = {
    "max_clients": (1, "one client at least"),
    "max_leases_per_client": (2, "a store group's put holds a member's lease and its manifest's at once"),
    "max_inflight_bytes_per_client": (1 << 20, "no put of an object larger than it can be stored"),
}
# A reader's lease must outlive its copy; the client takes a lease as ended at 80% of the TTL.
MIN_LEASE_TTL_S = 1.0


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_clients: int = 256
    max_leases_per_client: int = 4096
    # Bytes one client may hold reserved but not committed (its puts in flight). Reserved
    # extents cannot be evicted: without a bound, one client's abandoned reservations could
    # fill an arena. Keep it below host.arena_bytes; the client's put window adapts to it.
    max_inflight_bytes_per_client: int = field(default=256 << 20, metadata=SIZE)
    # Largest frame the daemon reads from a client; a bigger length header closes the connection.
    max_frame_bytes: int = field(default=MAX_FRAME_BYTES, metadata=SIZE)
    # A lease not released within this time is taken back (a stuck client cannot pin memory forever).
    lease_ttl_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("max_inflight_bytes_per_client", "max_frame_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name), f"limits.{name}"))
        for name, (least, why) in MIN_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgument(f"limits.{name} must be an integer >= {least} ({why}), got {value!r}")
        if not MIN_FRAME_BYTES <= self.max_frame_bytes <= MAX_FRAME_BYTES:
            raise InvalidArgument(f"limits.max_frame_bytes must be in {MIN_FRAME_BYTES}..{MAX_FRAME_BYTES}, "
                                  f"got {self.max_frame_bytes}")
        if not _positive_number(self.lease_ttl_s) or self.lease_ttl_s < MIN_LEASE_TTL_S:
            raise InvalidArgument(f"limits.lease_ttl_s must be a number of seconds >= {MIN_LEASE_TTL_S:g} (a reader's "
                                  f"lease must outlive its copy), got {self.lease_ttl_s!r}")


# cudaMalloc aligns to 256 bytes; the GPU tier's extents keep that (tiers/gpu.py)
GPU_ALIGNMENT_BYTES = 256


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """The `[gpu]` table: the GPU tier, one device buffer shared with local engines by CUDA
    IPC (`tiers.gpu.GpuTier` takes it as is). The daemon probes CUDA at start either way and
    reports what it found (startup log, `kvstore status`, `/v1/stats`). Off unless enabled:
    enabled, the daemon makes a device buffer of capacity_bytes at start, and refuses to
    start, naming the reason, where CUDA cannot run."""

    enabled: bool = False
    capacity_bytes: int = field(default=1 << 30, metadata=SIZE)
    device: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", parse_size(self.capacity_bytes, "gpu.capacity_bytes"))
        if self.capacity_bytes <= 0 or self.capacity_bytes % GPU_ALIGNMENT_BYTES:
            raise InvalidArgument(f"gpu.capacity_bytes must be a positive multiple of {GPU_ALIGNMENT_BYTES}, "
                                  f"got {self.capacity_bytes!r}")
        if not _int_in(self.device, 0, 1023):
            raise InvalidArgument(f"gpu.device must be a device index >= 0, got {self.device!r}")


@dataclass(frozen=True, slots=True)
class AdminConfig:
    enabled: bool = True
    # Loopback by default: the admin API can delete and evict; expose it deliberately.
    host: str = "127.0.0.1"
    port: int = 8470  # 0 picks a free port (written to <data_dir>/admin.addr)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidArgument(f"admin.port must be 0..65535, got {self.port!r}")


# Node ids and addresses are labels in logs, keys in etcd and inputs to rendezvous hashing.
_NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# Shorter secrets are guessable; 16 characters of a random token are 80+ bits.
MIN_SECRET_CHARS = 16


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Peers, membership and the remote tier (`[cluster]`, docs/cluster.md)."""

    enabled: bool = False
    node_id: str = ""  # empty: the host name
    listen: str = "127.0.0.1:8471"  # the peer service; set a routable address deliberately
    advertise: str = ""  # what peers dial; empty: `listen`
    transport: str = "tcp"  # "tcp" or "ucx"
    secret: str = ""  # shared by every node of the cluster
    secret_file: str = ""  # or read from this file (0600) at start
    membership: str = "static"  # "static" (`peers`) or "etcd"
    peers: tuple = ()  # "node_id=host:port" for every node, this one included
    etcd_endpoint: str = "http://127.0.0.1:2379"
    etcd_prefix: str = "/kvstore/members/"
    lease_ttl_s: float = 5.0  # a node that stops renewing leaves the member list after this
    replicas: int = 1  # home nodes per object
    peer_timeout_s: float = 1.0  # any remote call; a dead peer is a miss after this
    # When objects go to their home nodes: "write_through" copies each put there in the
    # background at commit; "write_back" only when the object leaves this node's last tier.
    # Either way an object about to leave that its homes are not known to hold is sent first.
    remote_write: str = "write_through"
    rehome: bool = True  # copy objects to their new homes when membership changes
    rehome_delay_s: float = 1.0  # let membership settle this long before a re-homing pass
    # On a clean stop, copy what this node holds to the nodes that take over its objects,
    # for at most this long, before leaving membership (etcd membership; 0 turns it off).
    handover_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", tuple(self.peers))
        if self.node_id and not _NODE_ID_RE.match(self.node_id):
            raise InvalidArgument(f"cluster.node_id must match {_NODE_ID_RE.pattern}, got {self.node_id!r}")
        if self.transport not in ("tcp", "ucx"):
            raise InvalidArgument(f"cluster.transport must be tcp or ucx, got {self.transport!r}")
        if self.membership not in ("static", "etcd"):
            raise InvalidArgument(f"cluster.membership must be static or etcd, got {self.membership!r}")
        parse_address(self.listen, any_port=True)
        if self.advertise:
            parse_address(self.advertise)
        self.peer_map()
        if self.remote_write not in ("write_through", "write_back"):
            raise InvalidArgument(f"cluster.remote_write must be write_through or write_back, got {self.remote_write!r}")
        if not isinstance(self.rehome, bool):
            raise InvalidArgument(f"cluster.rehome must be true or false, got {self.rehome!r}")
        if not isinstance(self.handover_s, (int, float)) or isinstance(self.handover_s, bool) \
                or not 0 <= self.handover_s <= 3600:
            raise InvalidArgument(f"cluster.handover_s must be a number in [0, 3600], got {self.handover_s!r}")
        for name in ("lease_ttl_s", "peer_timeout_s", "rehome_delay_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 3600:
                raise InvalidArgument(f"cluster.{name} must be a number in (0, 3600], got {value!r}")
        if not isinstance(self.replicas, int) or not 1 <= self.replicas <= 16:
            raise InvalidArgument(f"cluster.replicas must be an integer in 1..16, got {self.replicas!r}")
        if self.secret and len(self.secret) < MIN_SECRET_CHARS:
            raise InvalidArgument(f"cluster.secret must have at least {MIN_SECRET_CHARS} characters")
        if self.enabled and not (self.secret or self.secret_file):
            raise InvalidArgument("cluster.enabled needs cluster.secret or cluster.secret_file (shared by all nodes)")

    def peer_map(self) -> dict[str, str]:
        """`peers` as {node_id: "host:port"}."""
        out = {}
        for item in self.peers:
            node, sep, address = str(item).partition("=")
            if not sep or not _NODE_ID_RE.match(node):
                raise InvalidArgument(f"cluster.peers entries are 'node_id=host:port', got {item!r}")
            parse_address(address)
            if node in out:
                raise InvalidArgument(f"cluster.peers names node {node!r} twice")
            out[node] = address
        return out


@dataclass(frozen=True, slots=True)
class ServerConfig:
    data_dir: str = field(default_factory=default_data_dir)
    socket_path: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o600
    # Recompute the xxh3-128 of every put in the daemon and refuse a mismatch. Off by
    # default: the bytes never left the arena, and every tier crossing verifies anyway.
    verify_puts: bool = False
    log_level: str = "info"
    log_format: str = "kv"
    host: HostTierConfig = HostTierConfig()
    limits: LimitsConfig = LimitsConfig()
    admin: AdminConfig = AdminConfig()
    nvme: NvmeTierConfig = NvmeTierConfig()
    gpu: GpuConfig = GpuConfig()
    cluster: ClusterConfig = ClusterConfig()
    auth: AuthConfig = AuthConfig()
    events: EventsConfig = EventsConfig()
    remote: RemoteConfig = RemoteConfig()
    testing: TestingConfig = TestingConfig()  # race windows widened for tests (kvstore/config_testing.py)

    def __post_init__(self) -> None:
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise InvalidArgument(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.log_format not in ("kv", "json"):
            raise InvalidArgument(f"log_format must be kv or json, got {self.log_format!r}")
        if not isinstance(self.socket_mode, int) or not 0 <= self.socket_mode <= 0o777:
            raise InvalidArgument(f"socket_mode must be a file mode in 0..0o777 (e.g. 0o600), got {self.socket_mode!r}")
        if self.remote.mooncake_enabled and self.cluster.enabled:
            raise InvalidArgument('remote.backend = "mooncake" replaces the peer tier: set cluster.enabled = false '
                                  '(or remote.backend = "peers")')
        if len(os.fsencode(self.socket_path)) > 100:
            raise InvalidArgument(f"socket_path is too long for a Unix socket (max ~100 bytes): {self.socket_path}")

    @classmethod
    def from_dict(cls, data: dict) -> ServerConfig:
        return _build(cls, data, "")

    @property
    def nvme_path(self) -> str:
        return self.nvme.path or os.path.join(self.data_dir, "nvme")

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
            _check_type(prefix + name, known[name], value)
            values[name] = value
    try:
        return cls(**values)
    except TypeError as exc:
        raise InvalidArgument(f"bad config in {prefix or '<top>'}: {exc}") from None


# What each annotation admits from TOML, and how the error says it. bool is a subclass of
# int in Python: `arena_bytes = true` or `port = false` must not pass as 1 or 0.
_TYPES = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "tuple": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v), "a list of strings"),
    "dict": (lambda v: isinstance(v, dict), "a table"),
}
_SIZE_TYPE = (lambda v: isinstance(v, str) or _TYPES["int"][0](v), "a size (bytes, or a string like '64MiB')")


def _check_type(key: str, spec, value) -> None:
    """Refuse a TOML value whose type is not the field's (the value itself is checked by the
    dataclass). Every field's annotation must be in _TYPES: a new kind of field fails loudly."""
    accepts, kind = _SIZE_TYPE if spec.metadata.get("size") else _TYPES[spec.type]
    if not accepts(value):
        raise InvalidArgument(f"{key} must be {kind}, got {value!r}")
