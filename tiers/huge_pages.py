"""Which pages back a host arena: huge pages where the host offers them, else 4 KiB pages.

    hugetlb  the arena is a memfd of the host's reserved huge pages (MFD_HUGETLB): chosen when
             the free reserved pages (`vm.nr_hugepages`, less those promised to other
             mappings) cover the whole arena and the arena is a whole number of them
    thp      a 4 KiB-page memfd the kernel may back with transparent huge pages: the mapping
             is madvised MADV_HUGEPAGE, where /sys/kernel/mm/transparent_hugepage/shmem_enabled
             allows it (advise, always, within_size)
    off      4 KiB pages (`[host] huge_pages = "off"`, or neither of the above is offered)

A copy into or out of an arena walks its pages: with 2 MiB pages the TLB covers 512 times
more of it (bench/huge_pages.py measures the difference). Reserved huge pages are the host
operator's choice (`sysctl vm.nr_hugepages=N`); the daemon never changes kernel settings.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMINFO = "/proc/meminfo"
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_THP_ALLOWED = ("advise", "always", "within_size", "force")


@dataclass(frozen=True, slots=True)
class PageChoice:
    kind: str  # "hugetlb", "thp" or "off"
    reason: str  # why, in words for the log


def _meminfo(path: str) -> dict[str, int]:
    """The huge-page counts of /proc/meminfo (page counts; Hugepagesize in bytes)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.startswith("HugePages_") or name == "Hugepagesize":
                    parts = value.split()
                    fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError, IndexError):
        return {}
    return fields


def _shmem_thp(path: str) -> str | None:
    """The selected value of shmem_enabled ("[advise]" -> "advise"), or None if unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def choose(capacity_bytes: int, wanted: str, meminfo: str = MEMINFO, shmem_thp: str = SHMEM_THP) -> PageChoice:
    """The pages for an arena of `capacity_bytes` under `[host] huge_pages = wanted`."""
    if wanted == "off":
        return PageChoice("off", "host.huge_pages is off")
    info = _meminfo(meminfo)
    page = info.get("Hugepagesize", 0)
    free = info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)
    if page and capacity_bytes % page == 0 and free * page >= capacity_bytes:
        return PageChoice("hugetlb", f"{free} reserved huge pages of {page >> 20} MiB free")
    if not page or not info.get("HugePages_Total"):
        why = "no huge pages reserved (sysctl vm.nr_hugepages)"
    elif capacity_bytes % page:
        why = f"host.arena_bytes is not a multiple of the huge page size ({page >> 20} MiB)"
    else:
        why = f"{max(free, 0)} reserved huge pages free, {capacity_bytes // page} needed"
    thp = _shmem_thp(shmem_thp)
    if thp in _THP_ALLOWED:
        return PageChoice("thp", f"{why}; transparent huge pages for shared memory are {thp!r}")
    return PageChoice("off", f"{why}, and transparent huge pages for shared memory are {thp or 'unknown'!r} "
                             f"({shmem_thp}); 4 KiB pages")
