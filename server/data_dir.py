"""The data directory: made private, and held by one daemon at a time.

It holds the admin token, admin.addr and the NVMe index, which names every tenant's
objects. Two daemons on one directory would overwrite each other's admin.addr (and, with
NVMe, fight over one RocksDB), so the daemon takes an exclusive flock on `daemon.lock`
before it creates anything else there, and holds it until it has stopped. The lock file
keeps the holder's pid, so a refused daemon can say who holds it. The kernel drops a
flock when its holder dies, however it dies: a stale lock file never blocks a restart.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time

from kvstore.errors import ServiceError

log = logging.getLogger("kvstore.daemon")
LOCK_FILE = "daemon.lock"
# A busy lock whose file is still empty is read this many times, this far apart (0.5 s).
HOLDER_READS = 50
HOLDER_READ_GAP_S = 0.01


class DataDirError(ServiceError):
    """The data directory cannot be used: not a directory, not writable, or another daemon's."""

    code = "data_dir"


class HeldLock:
    """An exclusive flock on `lock_path` (made 0600), holding this process's pid;
    `release()` (idempotent) gives it up. Held by another: `error(busy.format(pid=...))`."""

    def __init__(self, lock_path: str, error: type[Exception], busy: str):
        self.path = lock_path
        self._fd = _lock(lock_path, error, busy)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the flock goes with the last fd; the file stays for the next daemon
            self._fd = -1


class DataDirLock(HeldLock):
    """The exclusive hold of one data directory."""

    def __init__(self, path: str):
        super().__init__(os.path.join(path, LOCK_FILE), DataDirError,
                         f"data directory {path} is in use by another kvstore daemon (pid {{pid}}); "
                         "stop that one, or give this one its own data_dir / --data-dir")


def hold_data_dir(path: str) -> DataDirLock:
    """Make `path` (mode 0700), or take an existing one that is this user's and that no one
    else can write, and lock it for this daemon. DataDirError, one line, if not."""
    try:
        _private_dir(path)
        return DataDirLock(path)
    except OSError as exc:
        raise DataDirError(f"cannot use data directory {path}: {_why(exc)}; "
                           "set data_dir in the config or --data-dir") from None


def ensure_dir(path: str, key: str) -> None:
    """Make the directory config key `key` names (nvme.path), or DataDirError naming the key."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    except OSError as exc:
        raise DataDirError(f"cannot use {key} {path}: {_why(exc)}") from None


def _private_dir(path: str) -> None:
    """Make the data directory (0700), or check an existing one. The daemon never changes the
    mode of a directory it did not make: it may be shared (a 1777 /tmp-like directory holding
    other users' files). One another user owns, or that group or others can write, is refused:
    they could replace the token or the index under the daemon. One only readable by others is
    used as it is: everything the daemon writes there is 0600 or 0700 itself."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    mode = refuse_unless_ours(path, st, DataDirError, "data directory",
                              "could replace the admin token or the index",
                              "The daemon never changes the mode of a directory it did not make: name a path that "
                              "does not exist yet (the daemon makes it 0700), or a directory only you can write "
                              "(data_dir / --data-dir)")
    if mode & 0o055:
        log.warning("event=data_dir_readable path=%s mode=%o (its files are private; chmod 700 it to hide "
                    "their names)", path, mode)


def private_directory(path: str, error: type[Exception], what: str, risk: str, fix: str) -> None:
    """Make directory `path` (0700, parents as needed), or take an existing one by
    refuse_unless_ours' rule; `error` naming `what` and `fix` if it cannot be made. Where a
    socket is bound: whoever could write its directory could serve at its path (the client
    socket's directory, server/socket_path.py; the event stream's ipc sockets', server/events)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise error(f"cannot make {what} {path}: {exc.strerror or exc}. {fix}") from None
    refuse_unless_ours(path, st, error, what, risk, fix)


def refuse_unless_ours(path: str, st: os.stat_result, error: type[Exception], what: str, risk: str,
                      fix: str) -> int:
    """The mode of directory `path` (stat `st`) if this user owns it and nobody else can write
    it; else `error`, naming the owner or the mode, what whoever controls it could do (`risk`)
    and `fix`. The data directory and every directory a socket is bound in share this rule."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        raise error(f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}), "
                    f"and whoever controls it {risk}. {fix}")
    if mode & 0o022:
        raise error(f"{what} {path} is mode {mode:o}: others can write it, and whoever controls it {risk}. {fix}")
    return mode


def _lock(lock_path: str, error: type[Exception], busy: str) -> int:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise error(busy.format(pid=holder)) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _holder(fd: int) -> str:
    """The pid the lock's holder wrote. It writes it just after taking the lock, so a file
    still empty is read again for a while (two daemons started together meet in between)."""
    for _ in range(HOLDER_READS):
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if holder:
            return holder
        time.sleep(HOLDER_READ_GAP_S)
    return "unknown"


def _why(exc: OSError) -> str:
    if isinstance(exc, FileExistsError | NotADirectoryError):
        return "it (or a parent) is not a directory"
    return exc.strerror or str(exc)
