"""The NVMe tier's directory: its RocksDB index and its preallocated data files.

    <path>/index/                RocksDB: namespace + object id -> record (index.py)
    <path>/data-00000.kvs ...    one data file per config.file_sizes() entry (files.py)

Opening creates what is missing, refuses a directory made with another layout (file_bytes,
verify block size), and rebuilds the extent maps from the index (recovery.py). An open that
fails closes what it opened and removes the data files it created: they hold nothing yet.

Reads and writes of an object's extent go through here: they run on the tier's I/O threads,
hold no lock, verify what they read, and turn an OSError into the kvstore error that names
the file (files.io_error), calling `on_io_error` first so the tier counts it.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from kvstore.config import NvmeTierConfig
from kvstore.errors import InvalidArgument, ServiceError
from kvstore.tiers.allocator import Extent
from kvstore.tiers.nvme.files import VERIFY_BLOCK_BYTES, DataFile, io_error, open_data_file, read_blocks, read_object, write_object
from kvstore.tiers.nvme.index import FORMAT_VERSION, NvmeIndex, NvmeRecord
from kvstore.tiers.nvme.recovery import Recovered, recover


class Volume:
    """An open directory. The tier owns it and closes it once, after the last I/O."""

    def __init__(self, index: NvmeIndex, files: list[DataFile], recovered: Recovered,
                 on_io_error: Callable[[], None]):
        self.index, self.files, self.recovered = index, files, recovered
        self._on_io_error = on_io_error

    @classmethod
    def open(cls, config: NvmeTierConfig, started: float, on_io_error: Callable[[], None]) -> Volume:
        """Open (creating what is missing) and recover the directory at config.path.
        `started` (time.monotonic()) dates the recovery report's time_to_ready_s."""
        os.makedirs(config.path, mode=0o700, exist_ok=True)  # the index names every tenant's objects
        index = NvmeIndex(os.path.join(config.path, "index"))
        files: list[DataFile] = []
        try:
            _check_format(index, config)
            for i, size in enumerate(config.file_sizes()):
                files.append(open_data_file(i, os.path.join(config.path, f"data-{i:05d}.kvs"), size))
            return cls(index, files, recover(index, files, started), on_io_error)
        except BaseException:
            _close(index, files, remove_created=True)  # they hold nothing yet
            raise

    @property
    def direct_io(self) -> bool:
        """Every data file is read and written with O_DIRECT (False: the file system refused)."""
        return all(f.direct for f in self.files)

    def write(self, file: int, extent: Extent, data: memoryview, sync: bool) -> tuple[bytes, bytes | None]:
        """Write data into an extent of data file `file` (files.write_object: xxh3-128 and
        block sums taken in the same pass, returned); with `sync`, return once it is on
        stable storage (one fdatasync shared by the writers in flight, files.SyncBarrier)."""
        f = self.files[file]
        try:
            written = write_object(f, extent.offset, data)
            if sync:
                f.barrier.sync(f.barrier.ticket())
        except OSError as e:
            raise self._failed(e, f"writing {len(data)} bytes at offset {extent.offset} of", f.path) from None
        return written

    def read(self, record: NvmeRecord, out: memoryview) -> bool:
        """Read the object into out[:size]. True when it matches its xxh3-128; False, with
        out[:size] zeroed, when it does not."""
        good = self._read(read_object, record, record.size, out) == record.checksum
        if not good:
            np.frombuffer(out, dtype=np.uint8)[: record.size] = 0
        return good

    def read_range(self, record: NvmeRecord, offset: int, length: int, out: memoryview) -> bool:
        """Read object bytes [offset, offset+length) into out[:length]. True when what was
        read verifies: the blocks the range touches against their xxh3-64 sums, or, for an
        object without block sums (one block or less), the whole object read aside."""
        if record.blocks is None:
            whole = memoryview(bytearray(record.size))
            good = self._read(read_object, record, record.size, whole) == record.checksum
            if good:
                out[:length] = whole[offset : offset + length]
            return good
        return self._read(read_blocks, record, record.size, record.blocks, offset, length, out[:length])

    def close(self) -> None:
        _close(self.index, self.files)
        self.files = []

    def _read(self, fn, record: NvmeRecord, *args):
        f = self.files[record.file]
        try:
            return fn(f, record.offset, *args)
        except OSError as e:
            raise self._failed(e, f"reading {record.size} bytes at offset {record.offset} of", f.path) from None

    def _failed(self, e: OSError, what: str, path: str) -> ServiceError:
        self._on_io_error()
        return io_error(e, what, path)


def _check_format(index: NvmeIndex, config: NvmeTierConfig) -> None:
    meta = {"format": FORMAT_VERSION, "file_bytes": config.file_bytes, "verify_block_bytes": VERIFY_BLOCK_BYTES}
    stored = index.read_meta()
    if stored is None:
        index.write_meta(meta)
    elif stored != meta:
        raise InvalidArgument(
            f"nvme tier {config.path} was created with {stored}, this config gives {meta}; "
            "start with the same file_bytes or an empty directory"
        )


def _close(index: NvmeIndex, files: list[DataFile], remove_created: bool = False) -> None:
    for f in files:
        os.close(f.fd)
        if remove_created and f.created:
            os.unlink(f.path)
    index.close()
