"""Who can connect to the event stream's Unix sockets (issue 41, item 11): whoever connects
reads every snapshot, routes' token ids (prompts) included. The sockets get `socket_mode`
(0600) whatever the daemon's umask, in directories the client socket's rule accepts."""

import contextlib
import errno
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest

from kvs_events import EventSubscriber, wait_subscribed
from kvstore.identity import ObjectId

UNREACHED = 255  # a child's exit status: it could not stat the socket's path


@contextlib.contextmanager
def umask(mask: int):
    """The umask of daemons started inside (a child inherits it)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def ipc_paths(d, name: str) -> list[str]:
    return [os.path.join(d.data_dir, f"{name}.pub"), os.path.join(d.data_dir, f"{name}.replay")]


def test_every_event_socket_is_0600_under_umask_002(daemon_factory):
    config = {"host": {"namespaces": ["default", "tenant"]},
              "events": {"enabled": True, "namespaces": {"tenant": {}}}}
    with umask(0o002):
        d = daemon_factory("16MiB", config=config)
    sockets = ipc_paths(d, "events") + ipc_paths(d, "events-tenant")
    assert {path: mode(path) for path in sockets} == {path: 0o600 for path in sockets}
    assert all(stat.S_ISSOCK(os.stat(path).st_mode) for path in sockets)
    sub = EventSubscriber(d, "default")  # the daemon's user still reads the stream
    try:
        with d.client() as c:
            wait_subscribed(sub, lambda: c.put(ObjectId(os.urandom(32)), b"probe"))
    finally:
        sub.close()


def test_an_ipc_endpoint_in_a_directory_not_made_yet_gets_one_made_0700(daemon_factory, tmp_path):
    elsewhere = tmp_path / "not-yet" / "sockets"
    config = {"events": {"enabled": True, "endpoint": f"ipc://{elsewhere}/events.pub",
                         "replay_endpoint": f"ipc://{elsewhere}/events.replay"}}
    with umask(0o002):
        daemon_factory("16MiB", config=config)
    assert mode(elsewhere) == 0o700
    assert [mode(elsewhere / name) for name in ("events.pub", "events.replay")] == [0o600, 0o600]


def test_a_namespace_of_its_own_may_open_its_sockets_to_a_group(daemon_factory):
    config = {"host": {"namespaces": ["default", "tenant"]},
              "events": {"enabled": True, "namespaces": {"tenant": {"socket_mode": 0o660}}}}
    with umask(0o022):
        d = daemon_factory("16MiB", config=config)
    assert [mode(p) for p in ipc_paths(d, "events-tenant")] == [0o660, 0o660]
    assert [mode(p) for p in ipc_paths(d, "events")] == [0o600, 0o600]


def test_an_ipc_endpoint_in_a_directory_others_can_write_is_refused_naming_its_key(unstarted_daemon, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could put another publisher at the path
    d = unstarted_daemon({"events": {"enabled": True, "endpoint": f"ipc://{shared}/events.pub"}})
    result = subprocess.run([sys.executable, "-m", "kvstore.commands.cli", "serve", "--config", d.config_path,
                             "--socket", d.socket], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert f"events.endpoint's directory {shared} is mode 777" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (shared / "events.pub").exists()


def _connect_as(uid: int, gid: int, path: str) -> str:
    """Connect a Unix socket to `path` in a forked child that dropped to uid/gid: "connected",
    the errno's name, or "unreached" if the child could not even stat the path (its
    directories must let it: the socket's own mode is what the test is about)."""
    pid = os.fork()
    if pid == 0:  # the child: no threads, only these calls; the exit status says what happened
        status = UNREACHED
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.stat(path)
            with socket.socket(socket.AF_UNIX) as s:
                status = s.connect_ex(path)
        finally:
            os._exit(status)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return "connected" if status == 0 else "unreached" if status == UNREACHED else errno.errorcode[status]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid of the daemon's group")
def test_another_uid_of_the_daemons_group_cannot_connect(unstarted_daemon):
    nobody = 65534
    d = unstarted_daemon({"events": {"enabled": True}})
    os.chmod(d.root, 0o750)  # the group may reach the data directory: only the sockets' mode stops it
    os.mkdir(d.data_dir, 0o750)
    os.chmod(d.data_dir, 0o750)
    try:
        with umask(0o002):  # group-writable files by default: what the issue saw
            d.start("16MiB")
        paths = ipc_paths(d, "events")
        assert [_connect_as(nobody, os.getegid(), p) for p in paths] == ["EACCES", "EACCES"]
        assert [_connect_as(os.geteuid(), os.getegid(), p) for p in paths] == ["connected", "connected"]
    finally:
        d.stop(signal.SIGKILL)
