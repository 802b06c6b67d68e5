"""The `[remote]` table: which remote tier sits below host and NVMe.

Pure validation, like the rest of kvstore/config.py (which composes RemoteConfig into
ServerConfig and refuses `backend = "mooncake"` beside `[cluster] enabled = true`).

    [remote]
    backend = "peers"              # "peers": kvstore's own peer tier, set up in [cluster]
                                   # "mooncake": an existing Mooncake Store pool, set up below

    [remote.mooncake]
    master = "10.0.0.5:50051"      # the mooncake_master RPC address (host:port)
    metadata_server = "P2PHANDSHAKE"   # or "http://host:port/metadata", "etcd://host:port"
    protocol = "tcp"               # "tcp" or "rdma"
    rdma_devices = ""              # e.g. "mlx5_0,mlx5_1" with protocol "rdma"
    local_hostname = "127.0.0.1"   # the address the pool's other clients reach this node at
    global_segment_bytes = 0       # memory this daemon lends to the pool; 0 = none (a client only)
    local_buffer_bytes = "64MiB"   # the Mooncake client's own transfer buffer
    replicas = 1                   # copies the pool keeps of each object
    tenant_id = "default"          # the Mooncake tenant this daemon's client uses (quotas)
    key_prefix = "kvstore/"        # pool keys: <key_prefix><namespace>/<object id hex>
    remote_write = "write_through" # or "write_back": only objects leaving this node go
    write_through_yield_ms = 200   # a write_through copy waits up to this long for the clients to
                                   # pause (server/traffic.py); 0: copies go at once
    write_through_quiet_ms = 10    # a pause: no request, and no shared-index read reported, this long
    retry_interval_s = 5.0         # master unreachable: how often to try again
    io_threads = 4                 # worker threads for the blocking Mooncake calls
    master_metrics_url = ""        # e.g. "http://10.0.0.5:9003/metrics": the master's Prometheus
                                   # endpoint, read for /v1/cluster and `kvstore status` (what the
                                   # pool holds); empty: not asked
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.units import check_seconds, parse_address, parse_size

REMOTE_BACKENDS = ("peers", "mooncake")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
# "P2PHANDSHAKE" (no metadata service), an HTTP metadata server, or etcd / redis.
_METADATA_RE = re.compile(r"^(P2PHANDSHAKE|https?://\S+|etcd://\S+|redis://\S+)$")
# A Mooncake key is a string; the prefix is ours and must not be confused with a namespace.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}/$")
_METRICS_RE = re.compile(r"^(|https?://\S+)$")
_HOST_RE = re.compile(r"^[A-Za-z0-9.:\[\]_-]{1,253}$")
# Past a few dozen, more threads only queue inside the Mooncake client; 64 bounds a typo.
MAX_IO_THREADS = 64
# A write_through copy waits for the clients to pause at most this long (a minute bounds a typo:
# longer, and a node that crashed would have lost what its steady traffic kept from the pool).
MAX_YIELD_MS = 60_000
# A pool object's header and the transfer need a buffer; below this Mooncake refuses transfers.
MIN_LOCAL_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """The `[remote.mooncake]` table (the module docstring shows every key)."""

    master: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = field(default=0, metadata={"size": True})
    local_buffer_bytes: int = field(default=64 << 20, metadata={"size": True})
    replicas: int = 1
    tenant_id: str = "default"
    key_prefix: str = "kvstore/"
    remote_write: str = "write_through"
    write_through_yield_ms: float = 200.0
    write_through_quiet_ms: float = 10.0
    retry_interval_s: float = 5.0
    io_threads: int = 4
    master_metrics_url: str = ""

    def __post_init__(self) -> None:
        key = "remote.mooncake."
        if self.master:
            try:
                parse_address(self.master)
            except InvalidArgument:
                raise InvalidArgument(f"{key}master must be host:port (the mooncake_master RPC address), "
                                      f"got {self.master!r}") from None
        if not isinstance(self.metadata_server, str) or not _METADATA_RE.match(self.metadata_server):
            raise InvalidArgument(f"{key}metadata_server must be \"P2PHANDSHAKE\" or an http://, etcd:// or "
                                  f"redis:// address, got {self.metadata_server!r}")
        if self.protocol not in MOONCAKE_PROTOCOLS:
            raise InvalidArgument(f"{key}protocol must be tcp or rdma, got {self.protocol!r}")
        if not isinstance(self.local_hostname, str) or not _HOST_RE.match(self.local_hostname):
            raise InvalidArgument(f"{key}local_hostname must be this node's address as the pool reaches it, "
                                  f"got {self.local_hostname!r}")
        object.__setattr__(self, "global_segment_bytes", parse_size(self.global_segment_bytes, f"{key}global_segment_bytes"))
        object.__setattr__(self, "local_buffer_bytes", parse_size(self.local_buffer_bytes, f"{key}local_buffer_bytes"))
        if self.local_buffer_bytes < MIN_LOCAL_BUFFER_BYTES:
            raise InvalidArgument(f"{key}local_buffer_bytes must be at least {MIN_LOCAL_BUFFER_BYTES} bytes, "
                                  f"got {self.local_buffer_bytes}")
        if type(self.replicas) is not int or not 1 <= self.replicas <= 16:
            raise InvalidArgument(f"{key}replicas must be an integer in 1..16, got {self.replicas!r}")
        if not isinstance(self.tenant_id, str) or not _HOST_RE.match(self.tenant_id):
            raise InvalidArgument(f"{key}tenant_id must be a short name (letters, digits, ._-), got {self.tenant_id!r}")
        if not isinstance(self.key_prefix, str) or not _PREFIX_RE.match(self.key_prefix):
            raise InvalidArgument(f"{key}key_prefix must be 1-64 of [A-Za-z0-9._:-] ending in '/', "
                                  f"got {self.key_prefix!r}")
        if self.remote_write not in ("write_through", "write_back"):
            raise InvalidArgument(f"{key}remote_write must be write_through or write_back, got {self.remote_write!r}")
        for name in ("write_through_yield_ms", "write_through_quiet_ms"):
            check_seconds(getattr(self, name), f"{key}{name}", MAX_YIELD_MS, unit="milliseconds")
        value = self.retry_interval_s
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 3600 \
                or math.isnan(value):
            raise InvalidArgument(f"{key}retry_interval_s must be a number in (0, 3600], got {value!r}")
        if type(self.io_threads) is not int or not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise InvalidArgument(f"{key}io_threads must be an integer in 1..{MAX_IO_THREADS}, got {self.io_threads!r}")
        if not isinstance(self.master_metrics_url, str) or not _METRICS_RE.match(self.master_metrics_url):
            raise InvalidArgument(f"{key}master_metrics_url must be empty or http(s)://host:port/metrics (the "
                                  f"master's --metrics_port), got {self.master_metrics_url!r}")


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The `[remote]` table: `backend` picks the remote tier; `mooncake` sets up that one."""

    backend: str = "peers"
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)

    def __post_init__(self) -> None:
        if self.backend not in REMOTE_BACKENDS:
            raise InvalidArgument(f"remote.backend must be one of {', '.join(REMOTE_BACKENDS)}, got {self.backend!r}")
        if self.backend == "mooncake" and not self.mooncake.master:
            raise InvalidArgument('remote.backend = "mooncake" needs remote.mooncake.master '
                                  '(the mooncake_master RPC address, host:port)')

    @property
    def mooncake_enabled(self) -> bool:
        return self.backend == "mooncake"
