"""Group commit for the NVMe tier: index changes that wait for the next synced batch.

    put    -> pending[key] = record        readable at once, lost by a crash until committed
    delete -> doomed += (key, record)      hidden at once; extent still allocated
    commit -> fdatasync the files written since the last commit
              write one synced batch: deletes of doomed keys, then puts of pending records
              drop what the batch covered; free the doomed extents (release())

A doomed extent is freed only after the batch that deletes its entry is on disk: were it
reused earlier, a crash could leave the old entry pointing at the new object's bytes. A key
may be doomed and pending at once (deleted, then put again); pending wins on lookup, and the
batch order (deletes first) leaves the new record in the index.

The tier's lock guards the state: every method but commit() expects the caller to hold it;
commit() takes the commit lock and then the tier's lock, briefly, around its I/O. In "sync"
durability the journal stays empty and no thread runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Callable

from kvstore.errors import ServiceError
from tiers.nvme_index import NvmeIndex, NvmeRecord
from tiers.nvme_io import DataFile, io_error

_log = logging.getLogger("kvstore.tiers.nvme")


class GroupJournal:
    def __init__(
        self, index: NvmeIndex, files: list[DataFile], lock: threading.Lock,
        release: Callable[[NvmeRecord], None], path: str,
    ):
        self._index, self._files, self._lock, self._release, self._path = index, files, lock, release, path
        self._pending: dict[bytes, tuple[NvmeRecord, bytes]] = {}
        self._doomed: list[tuple[bytes, NvmeRecord]] = []
        self._doomed_keys: Counter = Counter()
        self._dirty: set[int] = set()
        self._commit_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- state (caller holds the tier's lock) -------------------------------------------------

    def lookup(self, key: bytes) -> tuple[bool, NvmeRecord | None]:
        """(True, record) if a put waits, (True, None) if a delete hides the index entry,
        (False, None) if the index has the answer."""
        waiting = self._pending.get(key)
        if waiting is not None:
            return True, waiting[0]
        return bool(self._doomed_keys[key]), None

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    def hides(self, key: bytes) -> bool:
        """True when the index entry of key is not what a reader should see."""
        return key in self._pending or bool(self._doomed_keys[key])

    def add_put(self, key: bytes, record: NvmeRecord, value: bytes) -> None:
        self._pending[key] = (record, value)
        self._dirty.add(record.file)

    def add_delete(self, key: bytes, record: NvmeRecord) -> None:
        self._pending.pop(key, None)
        self._doomed.append((key, record))
        self._doomed_keys[key] += 1

    @property
    def has_deletes(self) -> bool:
        return bool(self._doomed)

    @property
    def num_waiting(self) -> int:
        return len(self._pending) + len(self._doomed)

    def pending(self) -> list[tuple[bytes, NvmeRecord]]:
        return [(k, r) for k, (r, _) in self._pending.items()]

    def doomed(self) -> list[NvmeRecord]:
        return [r for _, r in self._doomed]

    # -- commits ------------------------------------------------------------------------------

    def start(self, interval_s: float) -> None:
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="kvstore-nvme-commit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then commit what still waits (ServiceError if that fails)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.commit()

    def commit(self) -> None:
        """Make everything that waits durable now. Data first, then the index batch."""
        with self._commit_lock:
            with self._lock:
                if not self._pending and not self._doomed:
                    return
                puts = dict(self._pending)
                deletes = list(self._doomed)
                dirty, self._dirty = self._dirty, set()
            try:
                for i in sorted(dirty):
                    os.fdatasync(self._files[i].fd)
                self._index.write([(k, v) for k, (_, v) in puts.items()], [k for k, _ in deletes], sync=True)
            except (OSError, ServiceError) as e:
                with self._lock:
                    self._dirty |= dirty
                if isinstance(e, OSError):
                    raise io_error(e, "syncing data files under", self._path) from None
                raise
            with self._lock:
                for key, entry in puts.items():
                    if self._pending.get(key) is entry:
                        del self._pending[key]
                del self._doomed[: len(deletes)]  # only commit() removes, and from the front
                for key, record in deletes:
                    self._doomed_keys[key] -= 1
                    if not self._doomed_keys[key]:
                        del self._doomed_keys[key]
                    self._release(record)

    def _loop(self, interval_s: float) -> None:
        failing = False
        while not self._stop.wait(interval_s):
            try:
                self.commit()
                failing = False
            except ServiceError as e:
                if not failing:  # one line per failure streak, not one per interval
                    _log.error("nvme tier %s: group commit failed: %s", self._path, e.message)
                failing = True
