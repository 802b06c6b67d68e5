"""Does the host tier fit in this machine's memory? Checked before the daemon starts anything.

Arenas are memfds: shared memory, not counted in the daemon's RSS, so when they outgrow the
machine the kernel's OOM killer picks other processes first. A prefaulted arena is allocated
at start (host.namespaces of them); the others are made when a client first puts into a new
namespace, and the memory of an arena made without prefault is taken as it is written. So:

- one arena larger than the machine's memory is refused (it could never be filled);
- the arenas prefaulted at start must fit in what is available now, less a headroom;
- a namespace created later with prefault must fit in what is available then (CapacityError
  for that client, not an OOM kill for someone else).

Memory is MemTotal / MemAvailable from /proc/meminfo, lowered to the cgroup v2 limit
(v2 memory.max less memory.current, or v1 memory.limit_in_bytes less usage) when the daemon
runs in a limited cgroup, as in a container.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvstore.config import HostTierConfig
from kvstore.errors import CapacityError, InvalidArgument

# Room left for the kernel, the daemon itself and its clients: what prefaulted arenas may
# not take of the memory available. A tenth of the machine, at most 4 GiB.
HEADROOM_FRACTION = 0.1
MAX_HEADROOM_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class HostMemory:
    total_bytes: int
    available_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return min(int(self.total_bytes * HEADROOM_FRACTION), MAX_HEADROOM_BYTES)


def host_memory() -> HostMemory:
    """This machine's (or container's) memory now."""
    total, available = _meminfo()
    limit, used = _cgroup_memory()
    if limit is not None:
        total = min(total, limit)
        available = min(available, max(0, limit - used))
    return HostMemory(total, available)


def check_host_tier(host: HostTierConfig, memory: HostMemory) -> None:
    """InvalidArgument naming the key and the memory there is, when the arenas cannot fit."""
    if host.arena_bytes > memory.total_bytes:
        raise InvalidArgument(
            f"host.arena_bytes = {_gib(host.arena_bytes)} is more than this machine's memory "
            f"({_gib(memory.total_bytes)}); lower host.arena_bytes")
    if not host.prefault:
        return
    needed = host.arena_bytes * len(host.namespaces)
    room = memory.available_bytes - memory.headroom_bytes
    if needed > room:
        raise InvalidArgument(
            f"host.arena_bytes = {_gib(host.arena_bytes)} x {len(host.namespaces)} namespace(s) prefaulted at start "
            f"(host.namespaces) needs {_gib(needed)}, but only {_gib(memory.available_bytes)} of memory is available "
            f"and {_gib(memory.headroom_bytes)} stays free for the rest of the machine; lower host.arena_bytes, "
            "list fewer host.namespaces, or set host.prefault = false")


def check_new_arena(host: HostTierConfig, memory: HostMemory, namespace: str) -> None:
    """CapacityError when one more prefaulted arena would not fit in the memory available now."""
    if host.prefault and host.arena_bytes > memory.available_bytes - memory.headroom_bytes:
        raise CapacityError(
            f"no memory for namespace {namespace!r}: its arena (host.arena_bytes = {_gib(host.arena_bytes)}) "
            f"does not fit in the {_gib(memory.available_bytes)} available; free memory or lower host.arena_bytes")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _meminfo() -> tuple[int, int]:
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip().endswith("kB")}
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def _cgroup_memory() -> tuple[int | None, int]:
    """(limit, usage) of this process's memory cgroup (v2 or v1), or (None, 0) if unlimited."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None, 0
    for _, controllers, path in lines:
        if controllers == "memory":  # v1
            found = _read_limit(os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")),
                                "memory.limit_in_bytes", "memory.usage_in_bytes")
        elif controllers == "":  # v2
            found = _read_limit(os.path.join("/sys/fs/cgroup", path.lstrip("/")), "memory.max", "memory.current")
        else:
            continue
        if found is not None:
            return found
    return None, 0


def _read_limit(base: str, limit_file: str, usage_file: str) -> tuple[int, int] | None:
    try:
        with open(os.path.join(base, limit_file)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 62:  # v1 says "unlimited" with a huge number
            return None
        with open(os.path.join(base, usage_file)) as f:
            return int(limit), int(f.read())
    except (OSError, ValueError):
        return None
