"""The `[events]` table: the daemon's KV event stream for prefix-aware routers.

Pure validation, like the rest of kvstore/config.py (which composes EventsConfig into
ServerConfig); the daemon's publisher (server/events/) takes it with its endpoints filled in
(`EventsConfig.under(data_dir)`).

    [events]
    enabled = true
    endpoint = "tcp://127.0.0.1:5557"          # "" = ipc://<data_dir>/events.pub
    replay_endpoint = "tcp://127.0.0.1:5558"   # "" = ipc://<data_dir>/events.replay
    topic = "kvstore."                          # prefix of every namespace's topic
    buffer_batches = 10000                      # batches kept per namespace for replay
                                                # (and at most 1,000,000 events)
    hwm = 100000                                # ZMQ send high-water mark (per subscriber)
    int_block_hashes = true                     # bytes hashes as vLLM's default int form
    ownership = ""                              # "" = left out (as vLLM's engine events)
    heartbeat_s = 1.0                           # an empty batch repeating the last seq; 0 = none
    socket_mode = 0o600                         # of every ipc:// socket (the client socket's)

    [events.namespaces.tenant-a]                # this namespace on endpoints of its own only
    endpoint = "ipc:///run/kvstore/tenant-a.pub"        # "" = ipc://<data_dir>/events-<name>.pub
    replay_endpoint = "ipc:///run/kvstore/tenant-a.replay"
    socket_mode = 0o660                         # left out: events.socket_mode
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from kvstore.errors import InvalidArgument
from kvstore.identity import check_name

# tcp://host:port (a name, an IPv4 address, [IPv6] or *) or ipc://<path>. Port 0 is refused:
# subscribers must know where to connect, and the daemon does not publish a chosen port.
_TCP_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9*][A-Za-z0-9.*_-]*):(\d{1,5})$")
# A Unix socket path must fit sun_path (108 bytes with its NUL).
MAX_IPC_PATH_BYTES = 107
# Each namespace's ring keeps at most this many batches: a bound on a typo's memory, not a tuning.
MAX_BUFFER_BATCHES = 1_000_000
# Past this a slow subscriber's queue in the daemon is memory the operator did not mean to give.
MAX_HWM = 10_000_000
# A router that hears nothing for an hour has no use for the heartbeat; past it, a typo.
MAX_HEARTBEAT_S = 3600.0
# What a namespace's table of endpoints of its own may say.
_OWN_KEYS = ("endpoint", "replay_endpoint", "socket_mode")


def check_socket_mode(key: str, value) -> None:
    """Refuse anything but a file mode in 0..0o777; errors name `key`."""
    if type(value) is not int or not 0 <= value <= 0o777:
        raise InvalidArgument(f"{key} must be a file mode in 0..0o777 (e.g. 0o600), got {value!r}")


def check_endpoint(key: str, value) -> None:
    """Refuse anything but tcp://host:port (port 1..65535) or ipc://<path>; errors name `key`."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{key} must be a string, got {value!r}")
    if value.startswith("ipc://"):
        path = value[len("ipc://"):]
        if not path or len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            raise InvalidArgument(f"{key}: an ipc:// path of 1..{MAX_IPC_PATH_BYTES} bytes, got {value!r}")
        return
    match = _TCP_RE.match(value)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise InvalidArgument(f"{key} must be tcp://host:port (port 1..65535) or ipc://<path>, got {value!r}")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """The event stream (off unless enabled). Each namespace is its own stream: its topic,
    its gapless sequence numbers from 0 at start, its replay ring of `buffer_batches`."""

    enabled: bool = False
    endpoint: str = ""  # the PUB socket; "" = ipc://<data_dir>/events.pub
    replay_endpoint: str = ""  # the ROUTER socket for replays; "" = ipc://<data_dir>/events.replay
    topic: str = "kvstore."
    buffer_batches: int = 10_000
    hwm: int = 100_000
    # vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (on by default there): a block hash given as
    # bytes (an object id, or an engine's sha256 digest) is published as its last 8 bytes,
    # big-endian, an unsigned 64-bit integer. Routers that take vLLM's default form (Dynamo
    # takes no other) read it; false publishes the bytes.
    int_block_hashes: bool = True
    # Every event's `ownership` (vLLM's secondary tiers name themselves there); "" leaves it
    # out, as vLLM's engine events do: Dynamo 1.6 drops any event that has one.
    ownership: str = ""
    # Namespaces with endpoints of their own: name -> {"endpoint", "replay_endpoint"} ("" =
    # ipc://<data_dir>/events-<name>.pub / .replay). Such a namespace is published there only,
    # never on the shared endpoints: a tenant's subscriber sees its namespace alone, and an
    # ipc:// path's directory permissions say who may subscribe.
    namespaces: dict = field(default_factory=dict)
    # Every heartbeat_s seconds each namespace that published a batch sends an empty one
    # repeating its last sequence number (no number taken, not kept for replay): a router
    # learns the daemon lives and the latest number without waiting for a change. 0: none.
    heartbeat_s: float = 1.0
    # The mode of every ipc:// socket the stream binds, whatever the daemon's umask (as the
    # client socket's `socket_mode`): who can connect reads snapshots, and snapshots carry
    # the routes' token ids (prompts). A namespace's own endpoints may say otherwise.
    socket_mode: int = 0o600
    # Filled in by under(), not a key of the file: the data directory, where the stream
    # keeps which life of it this daemon is (server/events/lives.py); "": none (no daemon).
    data_dir: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value != "":
                check_endpoint(f"events.{name}", value)
        if self.endpoint and self.endpoint == self.replay_endpoint:
            raise InvalidArgument("events.endpoint and events.replay_endpoint must differ")
        if not isinstance(self.int_block_hashes, bool):
            raise InvalidArgument(f"events.int_block_hashes must be true or false, got {self.int_block_hashes!r}")
        if not isinstance(self.ownership, str) or len(self.ownership) > 64:
            raise InvalidArgument(f"events.ownership must be a string of at most 64 characters, got {self.ownership!r}")
        object.__setattr__(self, "namespaces", _own_endpoints(self.namespaces))
        taken = [e for e in (self.endpoint, self.replay_endpoint) if e]
        taken += [ends[k] for ends in self.namespaces.values() for k in ("endpoint", "replay_endpoint") if ends[k]]
        if len(taken) != len(set(taken)):
            raise InvalidArgument(f"events: every endpoint must differ, got {sorted(taken)}")
        if not isinstance(self.topic, str) or len(self.topic.encode()) > 256:
            raise InvalidArgument(f"events.topic must be a string of at most 256 bytes, got {self.topic!r}")
        if type(self.buffer_batches) is not int or not 1 <= self.buffer_batches <= MAX_BUFFER_BATCHES:
            raise InvalidArgument(f"events.buffer_batches must be an integer in 1..{MAX_BUFFER_BATCHES}, "
                                  f"got {self.buffer_batches!r}")
        if type(self.hwm) is not int or not 1 <= self.hwm <= MAX_HWM:
            raise InvalidArgument(f"events.hwm must be an integer in 1..{MAX_HWM}, got {self.hwm!r}")
        if (not isinstance(self.heartbeat_s, (int, float)) or isinstance(self.heartbeat_s, bool)
                or not 0 <= self.heartbeat_s <= MAX_HEARTBEAT_S):  # NaN fails the comparison too
            raise InvalidArgument(f"events.heartbeat_s must be a number of seconds in 0..{MAX_HEARTBEAT_S:g} "
                                  f"(0: no heartbeats), got {self.heartbeat_s!r}")
        check_socket_mode("events.socket_mode", self.socket_mode)

    def under(self, data_dir: str) -> EventsConfig:
        """This table with empty endpoints made ipc:// paths in `data_dir` (checked again), and
        `data_dir` kept for the stream's record of its lives."""
        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(data_dir, name)}"
        own = {ns: {**ends, "endpoint": ends["endpoint"] or ipc(f"events-{ns}.pub"),
                    "replay_endpoint": ends["replay_endpoint"] or ipc(f"events-{ns}.replay")}
               for ns, ends in self.namespaces.items()}
        filled = replace(self, endpoint=self.endpoint or ipc("events.pub"),
                         replay_endpoint=self.replay_endpoint or ipc("events.replay"), namespaces=own)
        object.__setattr__(filled, "data_dir", data_dir)  # not an argument: no config file sets it
        return filled

    def own_endpoints(self, namespace: str) -> EventsConfig | None:
        """The table a namespace with endpoints of its own is published under (its endpoints,
        and socket_mode if it names one, in place of the shared ones), or None for one
        published on the shared endpoints."""
        ends = self.namespaces.get(namespace)
        return None if ends is None else replace(self, namespaces={}, **ends)


def _own_endpoints(value) -> dict:
    """events.namespaces, checked: name -> {"endpoint", "replay_endpoint"} (both present),
    and "socket_mode" where the table names one."""
    if not isinstance(value, dict):
        raise InvalidArgument("events.namespaces must be a table of namespaces")
    out = {}
    for name, ends in value.items():
        check_name("events.namespaces: a namespace", name)  # before it is shown raw in a key below
        key = f"events.namespaces.{name}"
        if not isinstance(ends, dict) or not set(ends) <= set(_OWN_KEYS):
            raise InvalidArgument(f"{key} must be a table of {', '.join(_OWN_KEYS)}")
        if "socket_mode" in ends:
            check_socket_mode(f"{key}.socket_mode", ends["socket_mode"])
        ends = {**ends, "endpoint": ends.get("endpoint", ""), "replay_endpoint": ends.get("replay_endpoint", "")}
        if "" in ends.values() and ("/" in name or name in (".", "..")):
            raise InvalidArgument(f"{key}: a name of its own endpoints' files in the data directory "
                                  "(events-<name>.pub) has no '/': name both endpoints")
        for k in ("endpoint", "replay_endpoint"):
            if ends[k] != "":
                check_endpoint(f"{key}.{k}", ends[k])
        out[name] = ends
    return out
