"""Which life of its data directory a daemon is: batch numbers that never repeat across
restarts, and the namespaces a new life tells routers to forget.

    the daemon starts        begin(): reads <data_dir>/events.lives and writes it back with
                             the next life (fsync, rename) before anything is published
    life n numbers           each namespace's batches from first_seq = n * SEQ_PER_LIFE,
                             gapless within the life (server/events/stream.py)
    a namespace publishes    named(): the list of namespaces that ever published is written
    for the first time       again (in a worker thread), so the next life clears it even
                             after a SIGKILL

Why: a subscriber that follows vLLM's rules asks for a replay only when a number skips
(`seq > last + 1`). Numbers that started at 0 again read as "nothing new" after a restart, and
the new daemon's AllBlocksCleared, recorded before ZMQ reconnected the subscriber, was lost
with nothing to show it. A later life numbers past everything an earlier one did, so the first
frame a subscriber gets from it (a batch or a heartbeat) is a gap, and vLLM's replay brings
the life's first batch, which begins with AllBlocksCleared. No I/O per batch: one small write
at start, one per namespace the first time it publishes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading

from kvstore.server.data_dir import DataDirError

log = logging.getLogger("kvstore.events")
LIVES_FILE = "events.lives"
# Numbers one life may use per namespace: a batch every 10 ms (the flush interval) for 300
# years. Lives stay below 2**63 (signed on the wire, where a snapshot says -1) for 9,223,371
# starts; past that they start again at 1, and a router may miss that one restart.
SEQ_PER_LIFE = 10**12
MAX_LIFE = (2**63 - 1) // SEQ_PER_LIFE - 1


class OneLife:
    """A stream without a data directory (tests of the stream alone): life 0, nothing kept."""

    life = 0
    previous: tuple[str, ...] = ()

    @property
    def first_seq(self) -> int:
        return self.life * SEQ_PER_LIFE

    def begin(self) -> None:
        pass

    def named(self, namespace: str) -> None:
        pass

    def save(self) -> None:
        pass


class Lives(OneLife):
    """The record of a data directory's lives. begin() once, at the daemon's start (after it
    holds the data directory); named() on the event loop; save() on any thread."""

    def __init__(self, data_dir: str):
        self.path = os.path.join(data_dir, LIVES_FILE)
        self.life = 0
        self.previous = ()  # the namespaces earlier lives published: a new life clears them
        self._names: set[str] = set()
        self._latest: list[str] = []  # what the next save writes (a new list per change)
        self._lock = threading.Lock()  # one save at a time, the latest list last

    def begin(self) -> None:
        """Read the last life and write this one (DataDirError naming the file if it cannot)."""
        last, names = self._read()
        self.life = 0 if last is None else last + 1
        if self.life > MAX_LIFE:
            log.warning("event=events_lives_wrapped path=%s lives=%d", self.path, self.life)
            self.life = 1
        self.previous = tuple(names)
        self._names = set(names)
        self._latest = sorted(names)
        try:
            self.save()
        except OSError as exc:
            raise DataDirError(f"cannot write {self.path}: {exc.strerror or exc}; the data directory must be "
                               "writable") from None

    def named(self, namespace: str) -> None:
        """`namespace` publishes in this life: remembered for the next one. Event loop thread;
        written in a worker thread (or here, without a running loop)."""
        if namespace in self._names:
            return
        self._names.add(namespace)
        self._latest = sorted(self._names)
        try:
            asyncio.get_running_loop().run_in_executor(None, self._save_logged)
        except RuntimeError:
            self._save_logged()

    def save(self) -> None:
        """Write this life and the latest list of namespaces: a new file, fsynced, renamed over
        the old one (never half written). Any thread; OSError if it cannot."""
        with self._lock:
            body = json.dumps({"life": self.life, "namespaces": self._latest}).encode()
            tmp = self.path + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            directory = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def _save_logged(self) -> None:
        try:
            self.save()
        except OSError as exc:  # the next life may not clear this namespace at once (its first batch will)
            log.warning("event=events_lives_unsaved path=%s error=%r", self.path, exc.strerror or exc)

    def _read(self) -> tuple[int | None, list[str]]:
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return None, []
        except (OSError, ValueError) as exc:
            raise DataDirError(self._unreadable(exc)) from None
        if not isinstance(doc, dict):
            raise DataDirError(self._unreadable("not a record of lives"))
        life, names = doc.get("life"), doc.get("namespaces")
        if type(life) is not int or life < 0 or not isinstance(names, list) or \
                not all(isinstance(n, str) for n in names):
            raise DataDirError(self._unreadable("not a record of lives"))
        return life, names

    def _unreadable(self, why) -> str:
        return (f"{self.path} is unreadable ({why}): it numbers the event stream's batches across restarts. "
                "Remove it to start again from 0 (a router that stays connected may then miss this restart)")
