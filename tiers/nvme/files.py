"""Data files of the NVMe tier: preallocated files read and written with O_DIRECT.

O_DIRECT needs the buffer address, the file offset and the length aligned to the device's
logical block size; ALIGN (4 KiB) covers every device in use. A caller's buffer is used in
place when its address is aligned (a host-arena extent of whole pages is; a slot of a small
object is not) and only the last partial block goes through a small aligned tail buffer.
Unaligned buffers go through a per-thread bounce buffer in BOUNCE_BYTES pieces. Both are
anonymous mmaps: page-aligned, where a bytearray gives EINVAL.

A file system that refuses O_DIRECT at open (tmpfs answers EINVAL) gets buffered I/O and the
caller logs one warning; nothing else changes.

Checksums are taken over exactly the bytes that go to (or come from) the file, in the same
pass: xxh3-128 over the object, plus xxh3-64 per VERIFY_BLOCK_BYTES block for objects larger
than one block, which lets a ranged read verify only the blocks it touches.

Every function here runs on the tier's I/O threads and holds no lock; OSError propagates and
the tier maps it with `io_error`.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from array import array
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.config import NVME_ALIGN
from kvstore.errors import CapacityError, InvalidArgument, ServiceError

ALIGN = NVME_ALIGN  # 4096: the config checks capacity and file sizes against the same value
# Ranged reads verify whole blocks of this size. A paged layout's page of one layer is
# 16-64 KiB, so smaller blocks would save little read-around while inflating every index
# entry (8 bytes per block) and the per-put hashing loop.
VERIFY_BLOCK_BYTES = 64 * 1024
# Per-thread bounce buffer for unaligned callers' buffers: large enough that one pwrite moves
# a typical 4 MiB object, small enough that io_threads of them stay cheap.
BOUNCE_BYTES = 8 * 1024 * 1024
_ZEROS = bytes(ALIGN)


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SyncBarrier:
    """fdatasync of one file, shared by concurrent writers.

    A writer takes a ticket after its write returned, then calls sync(ticket). One caller at
    a time runs fdatasync and it covers every ticket taken before it started; the others wait
    for it, or run the next one. Eight 4 MiB puts in flight then pay for two or three flushes
    instead of eight (each flush costs 10-15 ms on this machine's disk).
    """

    def __init__(self, fd: int):
        self._fd = fd
        self._cond = threading.Condition()
        self._written = 0  # tickets handed out
        self._synced = 0  # every ticket up to this one is on stable storage
        self._running = False

    def ticket(self) -> int:
        with self._cond:
            self._written += 1
            return self._written

    def sync(self, ticket: int) -> None:
        """Return once ticket's write is durable. OSError from fdatasync propagates to the
        caller that ran it; the waiters then run their own."""
        with self._cond:
            while self._synced < ticket:
                if self._running:
                    self._cond.wait()
                    continue
                self._running, target = True, self._written
                self._cond.release()
                try:
                    os.fdatasync(self._fd)
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._cond.notify_all()
                self._synced = max(self._synced, target)


@dataclass(slots=True)
class DataFile:
    """One preallocated data file. The tier owns `fd`; pread/pwrite on it are thread-safe."""

    index: int
    path: str
    fd: int
    size_bytes: int
    direct: bool
    created: bool  # made by this open: whatever the index says lies in it is gone
    barrier: SyncBarrier


def open_data_file(index: int, path: str, size_bytes: int) -> DataFile:
    """Open (creating and preallocating if needed) a data file of at least size_bytes.

    An existing file is only grown, never rewritten, so a restart touches no data. ENOSPC
    while preallocating raises CapacityError naming the path and sizes.
    """
    created = not os.path.exists(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise io_error(e, "opening data file", path) from None
        fd, direct = os.open(path, flags, 0o600), False
    try:
        current = os.fstat(fd).st_size
        if current < size_bytes:
            os.posix_fallocate(fd, current, size_bytes - current)
            os.fsync(fd)
        if created:
            _fsync_dir(os.path.dirname(path))
    except OSError as e:
        os.close(fd)
        if created:
            os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            free = _free_bytes(os.path.dirname(path))
            raise CapacityError(
                f"nvme tier: cannot preallocate {path} to {size_bytes} bytes: no space left "
                f"({free} bytes free on that file system); free space or lower capacity_bytes"
            ) from None
        raise io_error(e, "preallocating data file", path) from None
    return DataFile(index, path, fd, size_bytes, direct, created, SyncBarrier(fd))


def io_error(e: OSError, what: str, path: str) -> ServiceError:
    """The kvstore error for an OSError: no space -> CapacityError, anything else (EIO...)
    -> ServiceError. The message names the path; the caller adds sizes where it has them."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"nvme tier: {what} {path}: no space left ({e.strerror})")
    return ServiceError(f"nvme tier: {what} {path} failed: [Errno {e.errno}] {e.strerror}")


def byte_view(data, *, writable: bool, what: str) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (memoryview, ndarray, mmap...)."""
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgument(f"{what} must support the buffer protocol, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument(f"{what} must be writable")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# -- writes ---------------------------------------------------------------------------------


def write_object(f: DataFile, offset: int, data: memoryview) -> tuple[bytes, bytes | None]:
    """Write data at offset (an ALIGN-aligned extent of round_up(len(data)) bytes, the
    padding zeroed). Returns (xxh3-128 of the bytes written, block sums or None)."""
    whole = xxhash.xxh3_128()
    sums = array("Q") if len(data) > VERIFY_BLOCK_BYTES else None
    if _aligned(data):
        body = len(data) - len(data) % ALIGN
        buffers = [data[:body]] if body else []
        _hash(whole, sums, data)
        if body < len(data):
            tail = _scratch().tail
            tail[: len(data) - body] = data[body:]
            tail[len(data) - body :] = _ZEROS[: ALIGN - (len(data) - body)]
            buffers.append(tail)
        _pwritev_all(f.fd, buffers, offset)
    else:
        bounce = _scratch().bounce
        for start in range(0, len(data), BOUNCE_BYTES):
            piece = data[start : start + BOUNCE_BYTES]
            padded = round_up(len(piece))
            bounce[: len(piece)] = piece
            bounce[len(piece) : padded] = _ZEROS[: padded - len(piece)]
            _hash(whole, sums, bounce[: len(piece)])
            _pwritev_all(f.fd, [bounce[:padded]], offset + start)
    return whole.digest(), (sums.tobytes() if sums is not None else None)


# -- reads ----------------------------------------------------------------------------------


def read_object(f: DataFile, offset: int, size: int, out: memoryview) -> bytes:
    """Read an object of `size` bytes at offset into out[:size] (bytes past size are left
    alone). Returns the xxh3-128 of what was read; the caller compares it."""
    whole = xxhash.xxh3_128()
    if _aligned(out):
        body = size - size % ALIGN
        buffers = [out[:body]] if body else []
        tail = _scratch().tail
        if body < size:
            buffers.append(tail)
        _preadv_all(f.fd, buffers, offset)
        if body < size:
            out[body:size] = tail[: size - body]
        whole.update(out[:size])
    else:
        bounce = _scratch().bounce
        for start in range(0, size, BOUNCE_BYTES):
            n = min(BOUNCE_BYTES, size - start)
            _preadv_all(f.fd, [bounce[: round_up(n)]], offset + start)
            whole.update(bounce[:n])
            out[start : start + n] = bounce[:n]
    return whole.digest()


def read_blocks(
    f: DataFile, offset: int, size: int, blocks: bytes, start: int, length: int, out: memoryview
) -> bool:
    """Copy object bytes [start, start+length) into out[:length], reading and verifying only
    the VERIFY_BLOCK_BYTES blocks they touch against `blocks` (xxh3-64 each, little-endian).
    Returns False on the first block that fails; out then holds unspecified bytes."""
    sums = array("Q")
    sums.frombytes(blocks)
    first, last = start // VERIFY_BLOCK_BYTES, (start + length - 1) // VERIFY_BLOCK_BYTES
    blocks_per_piece = BOUNCE_BYTES // VERIFY_BLOCK_BYTES
    bounce = _scratch().bounce
    for piece_first in range(first, last + 1, blocks_per_piece):
        piece_last = min(last, piece_first + blocks_per_piece - 1)
        lo = piece_first * VERIFY_BLOCK_BYTES
        hi = min((piece_last + 1) * VERIFY_BLOCK_BYTES, size)
        _preadv_all(f.fd, [bounce[: round_up(hi - lo)]], offset + lo)
        for b in range(piece_first, piece_last + 1):
            block = bounce[b * VERIFY_BLOCK_BYTES - lo : min((b + 1) * VERIFY_BLOCK_BYTES, size) - lo]
            if xxhash.xxh3_64_intdigest(block) != sums[b]:
                return False
        copy_lo, copy_hi = max(lo, start), min(hi, start + length)
        out[copy_lo - start : copy_hi - start] = bounce[copy_lo - lo : copy_hi - lo]
    return True


# -- internals ------------------------------------------------------------------------------


class _Scratch(threading.local):
    """Per-thread aligned buffers, made on first use and kept warm (first touch of fresh
    pages costs about ten copies' worth)."""

    def __init__(self) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        self.bounce = memoryview(mmap.mmap(-1, BOUNCE_BYTES, flags=flags))
        self.tail = memoryview(mmap.mmap(-1, ALIGN, flags=flags))


_scratch_local: _Scratch | None = None


def _scratch() -> _Scratch:
    global _scratch_local
    if _scratch_local is None:
        _scratch_local = _Scratch()
    return _scratch_local


def _aligned(view: memoryview) -> bool:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0


def _hash(whole, sums: array | None, view: memoryview) -> None:
    """Feed view to the whole-object hash and, when sums is kept, one xxh3-64 per block.
    Callers pass pieces that start on a block boundary."""
    if sums is None:
        whole.update(view)
        return
    for i in range(0, len(view), VERIFY_BLOCK_BYTES):
        block = view[i : i + VERIFY_BLOCK_BYTES]
        whole.update(block)
        sums.append(xxhash.xxh3_64_intdigest(block))


def _pwritev_all(fd: int, buffers: list, offset: int) -> None:
    _vectored_all(os.pwritev, fd, buffers, offset, "write made no progress")


def _preadv_all(fd: int, buffers: list, offset: int) -> None:
    _vectored_all(os.preadv, fd, buffers, offset, "short read: the extent lies past the end of the file")


def _vectored_all(io, fd: int, buffers: list, offset: int, stalled: str) -> None:
    """os.pwritev / os.preadv until every buffer is done; EIO (`stalled`) if a call moves nothing."""
    pending = list(buffers)
    while pending:
        done = io(fd, pending, offset)
        if done <= 0:
            raise OSError(errno.EIO, stalled)
        offset += done
        _advance(pending, done)


def _advance(pending: list, done: int) -> None:
    while done and pending:
        if done >= len(pending[0]):
            done -= len(pending.pop(0))
        else:
            pending[0] = pending[0][done:]
            done = 0


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path or ".")
    return st.f_bavail * st.f_frsize
