"""The daemon's socket path: in a directory only this user controls, one daemon at a time.

Clients find the daemon by path, so whoever controls the path's directory controls what they
talk to: another user who can write it could move the socket aside and listen in its place.
The daemon makes the directory itself (0700), or takes an existing one only when it belongs to
this user and nobody else can write it (/tmp itself, or a /tmp/kvstore-<uid> another user made
first, is refused). Clients check who serves as well (client/daemon_peer.py).

Two daemons started together on one path: each takes an flock on `<socket>.lock` before it
looks at the path and holds it until it has stopped, so the second is refused by name before
it makes anything, instead of both binding and the first being orphaned.
"""

from __future__ import annotations

import os
import socket
import stat

from kvstore.errors import ServiceError
from kvstore.server.data_dir import HeldLock, private_directory


class SocketPathError(ServiceError):
    """The socket path cannot be used: its directory is not private, or a daemon serves there."""

    code = "socket_path"


def claim_socket_path(path: str) -> HeldLock:
    """Make or check the socket's directory, lock the path for this daemon and clear a stale
    socket. The lock is released when the daemon has stopped (after it removed its socket)."""
    directory = os.path.dirname(os.path.abspath(path))
    _private_directory(directory)
    try:
        lock = HeldLock(path + ".lock", SocketPathError,
                        f"another kvstore daemon (pid {{pid}}) is starting or serving at {path}; "
                        "stop it or use another socket_path / --socket")
    except OSError as exc:
        raise SocketPathError(f"cannot lock the socket path {path} ({path}.lock: {exc.strerror or exc}); "
                              "set socket_path in the config or --socket") from None
    try:
        _clear_stale(path)
    except BaseException:
        lock.release()
        raise
    return lock


def _private_directory(directory: str) -> None:
    private_directory(directory, SocketPathError, "the socket's directory", "could put another server at the socket's path",
                      "Name a socket in a directory only you can write, or in one that does not exist yet "
                      "(the daemon makes it 0700): socket_path / --socket, $KVSTORE_SOCKET or $XDG_RUNTIME_DIR")


def _clear_stale(path: str) -> None:
    """Remove a socket left by a dead daemon; refuse to start beside a live one."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketPathError(f"{path} exists and is not a socket; remove it or choose another socket_path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a stale socket
        return
    finally:
        probe.close()
    raise SocketPathError(f"a daemon is already serving at {path}; stop it or use another socket_path")
