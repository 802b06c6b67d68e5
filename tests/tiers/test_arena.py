import logging
import mmap
import os
import socket

import pytest

from kvstore.errors import InvalidArgument
from kvstore.tiers.allocator import Extent
from kvstore.tiers.arena import MAX_MEMFD_NAME_BYTES, HostArena, memfd_name

CAP = 64 * 4096


@pytest.fixture
def arena():
    with HostArena("tenant-a", CAP) as a:
        yield a


def client_map(fd: int, size: int = CAP) -> mmap.mmap:
    """What a client does with the fd it received: its own, independent mapping."""
    dup = os.dup(fd)
    try:
        return mmap.mmap(dup, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(dup)


def test_write_through_view_read_through_second_mapping(arena):
    first, second = arena.alloc(5000), arena.alloc(4096)
    payload = os.urandom(5000)
    view = arena.view(first)
    view[:5000] = payload
    view.release()
    other = client_map(arena.fd)
    assert other[first.offset : first.offset + 5000] == payload
    assert other[second.offset : second.end] == bytes(4096)  # extents do not alias
    other[second.offset : second.offset + 4] = b"back"  # and the client's writes show up here
    with arena.view(second) as back:
        assert bytes(back[:4]) == b"back"
    other.close()
    arena.check_integrity()


def test_view_is_zero_copy_and_sized_to_the_extent(arena):
    extent = arena.alloc(3 * 4096)
    with arena.view(extent) as a, arena.view(extent) as b:
        assert len(a) == extent.length and not a.readonly
        a[0] = 42
        assert b[0] == 42  # both views are windows on the same memory


def test_memfd_has_no_name_under_dev_shm():
    # Other processes may use /dev/shm meanwhile: look for this arena's name only.
    with HostArena("tenant-shm-check", CAP) as a:
        assert os.readlink(f"/proc/self/fd/{a.fd}").startswith("/memfd:kvstore-tenant-shm-check")
        assert not [n for n in os.listdir("/dev/shm") if "shm-check" in n]
    assert not [n for n in os.listdir("/dev/shm") if "shm-check" in n]


def test_prefault_allocates_memory_at_start():
    with HostArena("warm", CAP) as warm, HostArena("cold", CAP, prefault=False) as cold:
        assert os.fstat(warm.fd).st_blocks * 512 >= CAP
        assert os.fstat(cold.fd).st_blocks == 0


def test_client_cannot_resize_the_memfd(arena):
    for size in (0, CAP // 2, 2 * CAP):
        with pytest.raises(PermissionError):
            os.ftruncate(arena.fd, size)
    arena.check_integrity()


def test_close_is_idempotent_and_closes_the_fd():
    a = HostArena("tenant-close", CAP)
    fd = a.fd
    a.close()
    a.close()
    assert a.closed and a.fd == -1
    try:
        assert not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvstore-tenant-close")
    except FileNotFoundError:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        a.alloc(4096)
    with pytest.raises(RuntimeError, match="closed"):
        a.view(Extent(0, 4096))


def test_close_with_live_view_warns_and_defers_unmap(caplog):
    a = HostArena("tenant-leaky", CAP)
    view = a.view(a.alloc(4096))
    view[:3] = b"abc"
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.arena"):
        a.close()
    assert "memoryviews" in caplog.text and "tenant-leaky" in caplog.text
    assert bytes(view[:3]) == b"abc"  # still mapped while the view lives
    view.release()
    a.close()


@pytest.mark.parametrize("capacity", [0, -4096, 4095, 4097, CAP + 1, 4096.0, True, "4096"])
def test_bad_capacity_rejected(capacity):
    with pytest.raises(InvalidArgument, match="multiple of 4096"):
        HostArena("tenant-a", capacity)


@pytest.mark.parametrize("namespace", ["", None, "a\0b"])
def test_bad_namespace_rejected(namespace):
    with pytest.raises(InvalidArgument):
        HostArena(namespace, CAP)


def test_view_outside_arena_rejected(arena):
    with pytest.raises(InvalidArgument):
        arena.view(Extent(CAP - 4096, 8192))
    with pytest.raises(InvalidArgument):
        arena.view((0, 4096))


def test_alloc_free_delegate_to_allocator(arena):
    extents = []
    while arena.can_alloc(4096):
        extents.append(arena.alloc(4096))
    assert len(extents) == CAP // 4096 and arena.alloc(1) is None
    assert arena.allocator.free_bytes == 0
    arena.free(extents[3])
    assert arena.alloc(4096) == extents[3]
    arena.check_integrity()


def test_fd_passed_over_unix_socket_maps_the_same_bytes(arena):
    extent = arena.alloc(8192)
    payload = os.urandom(8192)
    with arena.view(extent) as view:
        view[:] = payload
    server_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with server_end, client_end:
        socket.send_fds(server_end, [b"arena"], [arena.fd])
        message, fds, _, _ = socket.recv_fds(client_end, 64, 1)
    assert message == b"arena" and len(fds) == 1 and fds[0] != arena.fd
    try:
        size = os.fstat(fds[0]).st_size
        assert size == CAP
        mapping = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fds[0])
    assert mapping[extent.offset : extent.end] == payload
    mapping[extent.offset : extent.offset + 5] = b"hello"
    with arena.view(extent) as view:
        assert bytes(view[:5]) == b"hello"
    mapping.close()


@pytest.mark.parametrize("namespace", ["a" * 256, "界" * 100, "𝄞" * 256, "a" + "界" * 90])
def test_a_long_namespace_makes_an_arena_its_memfd_name_cut_in_bytes_at_a_character(namespace):
    name = memfd_name(f"kvstore-{namespace}")
    assert len(name.encode()) <= MAX_MEMFD_NAME_BYTES and f"kvstore-{namespace}".startswith(name)
    assert len(name.encode()) > MAX_MEMFD_NAME_BYTES - 4  # cut at the last whole character, no sooner
    with HostArena(namespace, CAP) as a:
        assert os.readlink(f"/proc/self/fd/{a.fd}").startswith(f"/memfd:{name}")


def test_compact_gives_back_the_allocators_maps_after_mass_frees():
    with HostArena("tenant-c", 20_000 * 4096, prefault=False) as a:
        got = a.alloc_many(4096, 19_000)
        assert not a.compact()
        for x in got[1:]:
            a.free(x)
        assert a.compact() and not a.compact()
        a.check_integrity()
        assert a.allocator.num_allocated == 1
    assert not a.compact()  # closed: nothing to do
