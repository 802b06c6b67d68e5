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

Readers see the journal laid over the index (find, holds, records): a pending put is found
before its entry is written, a doomed key's entry is hidden while it is still there.

The tier's lock guards the state: every method but commit() expects the caller to hold it;
commit() takes the commit lock and then the tier's lock, briefly, around its I/O. In "sync"
durability the journal stays empty and no thread runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Callable, Iterator

from kvstore.errors import ServiceError
from kvstore.identity import ObjectId
from kvstore.tiers.nvme.files import DataFile, io_error
from kvstore.tiers.nvme.index import NvmeIndex, NvmeRecord, split_key

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

    def hides(self, key: bytes) -> bool:
        """True when the index entry of key is not what a reader should see."""
        return key in self._pending or bool(self._doomed_keys[key])

    def durability(self, key: bytes) -> str:
        """"group" while the key's put waits for its commit, else "sync"."""
        return "group" if key in self._pending else "sync"

    def find(self, key: bytes) -> NvmeRecord | None:
        """The record a reader sees for key: the waiting put's, else the index's unless a
        waiting delete hides it."""
        known, record = self.lookup(key)
        if known:
            return record
        value = self._index.get(key)
        return None if value is None else NvmeRecord.decode(value)

    def holds(self, key: bytes) -> bool:
        """find(key) is not None, without decoding the index's record."""
        known, record = self.lookup(key)
        return record is not None if known else self._index.get(key) is not None

    def visible(self, skip: set[bytes]) -> dict[bytes, NvmeRecord]:
        """Every record a reader sees, keys in `skip` aside. Reads the whole index."""
        found = dict(self.pending())
        for key, value in self._index.items():
            if not self.hides(key) and key not in skip:
                found[key] = NvmeRecord.decode(value)
        return found

    def records(self, prefix: bytes) -> Iterator[tuple[str, ObjectId, NvmeRecord, str]]:
        """(namespace, object id, record, durability) of every object whose key starts with
        prefix: waiting puts first, then the index in key order. Takes the tier's lock
        itself, never while the caller consumes: weakly consistent, as the index iterator is."""
        with self._lock:
            pending = [(k, r) for k, r in self.pending() if k.startswith(prefix)]
        for key, record in pending:
            yield *split_key(key), record, "group"
        for key, value in self._index.items(prefix):
            with self._lock:
                hidden = self.hides(key)
            if not hidden and (parts := split_key(key)) is not None:
                yield *parts, NvmeRecord.decode(value), "sync"

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
                    _log.error("event=nvme_group_commit_failed path=%s error=%r", self._path, e.message)
                failing = True
