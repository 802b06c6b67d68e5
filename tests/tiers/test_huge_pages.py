"""Huge pages for host arenas (tiers/huge_pages.py, tiers/arena.py): which pages a host offers,
arenas on reserved huge pages that clients map like any other, and the fall-back to 4 KiB pages.

The tests that need reserved huge pages reserve a few themselves (root writes
/proc/sys/vm/nr_hugepages, put back afterwards); they skip, saying so, where that is refused.
"""

import logging
import mmap
import os

import pytest

from kvstore.config import HostTierConfig
from kvstore.errors import InvalidArgument
from kvstore.tiers.arena import HostArena
from kvstore.tiers.huge_pages import choose
from kvs_testing import reserved_huge_pages

MiB = 1 << 20


def meminfo(tmp_path, total=0, free=0, rsvd=0, size_kb=2048):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       24000000 kB\nHugePages_Total:    {total}\nHugePages_Free:     {free}\n"
                    f"HugePages_Rsvd:     {rsvd}\nHugePages_Surp:        0\nHugepagesize:       {size_kb} kB\n")
    return str(path)


def shmem(tmp_path, selected):
    path = tmp_path / "shmem_enabled"
    path.write_text(" ".join(f"[{v}]" if v == selected else v
                             for v in ("always", "within_size", "advise", "never", "deny", "force")) + "\n")
    return str(path)


def test_reserved_huge_pages_are_chosen_only_when_they_cover_the_whole_arena(tmp_path):
    never = shmem(tmp_path, "never")
    got = choose(64 * MiB, "auto", meminfo(tmp_path, total=64, free=40), never)
    assert got.kind == "hugetlb" and "40 reserved huge pages of 2 MiB free" in got.reason
    short = choose(64 * MiB, "auto", meminfo(tmp_path, total=64, free=40, rsvd=10), never)  # 30 free really
    assert short.kind == "off" and "30 reserved huge pages free, 32 needed" in short.reason
    odd = choose(63 * MiB, "auto", meminfo(tmp_path, total=64, free=64), never)
    assert odd.kind == "off" and "not a multiple of the huge page size (2 MiB)" in odd.reason
    none = choose(64 * MiB, "auto", meminfo(tmp_path), never)
    assert none.kind == "off" and "no huge pages reserved (sysctl vm.nr_hugepages)" in none.reason
    assert "4 KiB pages" in none.reason and "'never'" in none.reason


@pytest.mark.parametrize("selected", ["advise", "always", "within_size"])
def test_transparent_huge_pages_where_shared_memory_allows_them(tmp_path, selected):
    got = choose(64 * MiB, "auto", meminfo(tmp_path), shmem(tmp_path, selected))
    assert got.kind == "thp" and repr(selected) in got.reason


def test_off_is_off_and_an_unreadable_host_means_4_KiB_pages(tmp_path):
    assert choose(64 * MiB, "off", meminfo(tmp_path, total=64, free=64), shmem(tmp_path, "always")).kind == "off"
    missing = str(tmp_path / "absent")
    got = choose(64 * MiB, "auto", missing, missing)
    assert got.kind == "off" and "'unknown'" in got.reason


def test_the_setting_is_checked_and_named():
    assert HostTierConfig().huge_pages == "auto"
    with pytest.raises(InvalidArgument, match=r"host.huge_pages must be one of \['auto', 'off'\], got 'yes'"):
        HostTierConfig(huge_pages="yes")


def _page_size_of(mapping_addr: int) -> int | None:
    """KernelPageSize (bytes) of this process's mapping starting at `mapping_addr`."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-")[0] == f"{mapping_addr:x}" or line.split("-")[0] == f"{mapping_addr:08x}":
            for field in lines[i + 1:i + 30]:
                if field.startswith("KernelPageSize:"):
                    return int(field.split()[1]) * 1024
    return None


def test_an_arena_on_reserved_huge_pages_is_mapped_by_clients_like_any_other():
    import ctypes
    with reserved_huge_pages(8):
        choice = choose(8 * MiB, "auto")
        assert choice.kind == "hugetlb", choice.reason
        with HostArena("huge", 8 * MiB, prefault=True, pages=choice.kind) as arena:
            assert arena.pages == "hugetlb"
            extent = arena.alloc(3 * MiB)
            payload = os.urandom(3 * MiB)
            with arena.view(extent) as view:
                view[:] = payload
                addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) - extent.offset
            assert _page_size_of(addr) == 2 * MiB  # the daemon's mapping is of 2 MiB pages
            dup = os.dup(arena.fd)  # what a client does with the fd it is sent
            try:
                other = mmap.mmap(dup, 8 * MiB, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(dup)
            assert other[extent.offset:extent.end] == payload
            other.close()
            arena.check_integrity()


def test_reserved_pages_taken_meanwhile_fall_back_to_4_KiB_pages_logged(caplog):
    caplog.set_level(logging.WARNING, logger="kvstore.tiers.arena")
    with reserved_huge_pages(2):  # fewer than the arena needs: as if another took them
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) for line in f if line.startswith("HugePages_Free:"))
        with HostArena("fallback", (free + 1) * 2 * MiB, prefault=True, pages="hugetlb") as arena:
            assert arena.pages == "off"
            extent = arena.alloc(MiB)
            with arena.view(extent) as view:
                view[:4] = b"kept"
                assert bytes(view[:4]) == b"kept"
    assert any("event=huge_pages_fallback namespace=fallback" in r.getMessage() for r in caplog.records)


def test_transparent_huge_pages_leave_the_arena_working():
    with HostArena("thp", 8 * MiB, prefault=True, pages="thp") as arena:
        assert arena.pages in ("thp", "off")  # "off" where the kernel refuses the advice
        extent = arena.alloc(2 * MiB)
        with arena.view(extent) as view:
            view[-4:] = b"tail"
        dup = os.dup(arena.fd)
        try:
            other = mmap.mmap(dup, 8 * MiB, flags=mmap.MAP_SHARED)
        finally:
            os.close(dup)
        assert other[extent.end - 4:extent.end] == b"tail"
        other.close()


def test_the_daemon_says_once_which_pages_its_arenas_get(caplog):
    import asyncio

    from kvstore.server.tiering.host import HostTier
    caplog.set_level(logging.INFO, logger="kvstore.tiers")
    host = HostTier(HostTierConfig(arena_bytes=MiB, prefault=False, huge_pages="off", namespaces=()))

    async def open_two():
        for name in ("a", "b"):
            await host.open_namespace(name)
    asyncio.run(open_two())
    said = [r.getMessage() for r in caplog.records if "event=arena_pages" in r.getMessage()]
    assert said == ["event=arena_pages pages=off reason='host.huge_pages is off'"]
    assert host.stats()[0]["b"]["pages"] == "off"
    host.close()
