"""Tenants (namespaces) cannot reach each other: not through the client, not by guessing
lease ids, not by asking for another tenant's arena fd. The admin API is operator scope
(one token sees every namespace, by design). Default file modes keep other users out.
The peer side (remote tier) is tested with the cluster work.
"""

from __future__ import annotations

import array
import json
import mmap
import os
import socket
import shutil
import stat
import tempfile

import numpy as np
import pytest

from hardening_support import MiB, assert_clean, content, key, nvme, size_of
from kvs_testing import commit_one
from kvstore import StateDescriptor
from kvstore.config import ServerConfig
from kvstore import messages as m
from kvstore.errors import InvalidArgument, NotFound, PermissionDenied
from kvstore.protocol import FrameCodec, Reply, Request
from kvstore.server.admin.client import AdminRequestFailed
from kvstore.server.data_dir import LOCK_FILE

TOKEN_A, TOKEN_B = "tenant-a-token-0123456789", "tenant-b-token-9876543210"
AUTH = f"""[auth]
unlisted = "deny"
[auth.namespaces.tenant-a]
token = "{TOKEN_A}"
[auth.namespaces.tenant-b]
token = "{TOKEN_B}"
"""


@pytest.mark.parametrize("auth, match", [
    ({"unlisted": "maybe"}, "auth.unlisted"),
    ({"namespaces": {"t": {}}}, "auth.namespaces.t needs a token or uids"),
    ({"namespaces": {"t": {"token": "short"}}}, "at least 16"),
    ({"namespaces": {"t": {"tokn": "x" * 20}}}, r"auth.namespaces.t.tokn"),
    ({"namespaces": {"t": {"uids": [True]}}}, "uids"),
    ({"namespaces": {"t": {"uids": "1000"}}}, "uids"),
    ({"namespaces": ["t"]}, "must be a table"),
])
def test_bad_auth_config_is_refused_with_the_key_named(auth, match):
    with pytest.raises(InvalidArgument, match=match):
        ServerConfig.from_dict({"auth": auth})


def test_tokens_never_show_in_the_config_repr():
    config = ServerConfig.from_dict({"auth": {"namespaces": {"t": {"token": TOKEN_A}}}})
    assert config.auth.namespaces["t"].token == TOKEN_A and TOKEN_A not in repr(config)


def open_raw(path: str, namespace: str, token: str | None = None, index: bool = False) -> tuple[Reply, list[int]]:
    """Ask for a namespace on a fresh connection: the reply and the fds that came with it
    (index: the shared index's too)."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(20)
    sock.connect(path)
    sock.sendall(FrameCodec().send_request(Request(1, "open", m.OpenNamespace(namespace, token, index=index).to_args())))
    codec, fds = FrameCodec(), []
    try:
        while not isinstance(event := codec.next_event(), Reply):
            data, anc, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
            assert data, "closed without a reply"
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", payload[:len(payload) - len(payload) % 4])
            codec.receive_data(data)
    finally:
        sock.close()
    return event, fds


def test_tenants_cannot_read_list_lookup_delete_or_time_each_others_objects(make_daemon):
    d = make_daemon({"nvme": nvme()}, AUTH)
    desc = StateDescriptor("tenant-a", "m", "r")
    a = d.client(namespace="tenant-a", token=TOKEN_A)
    secrets = [key("secret", i) for i in range(6)]
    for k in secrets:
        a.put(k, content(k, size_of(k)), desc)
    held = a.get(secrets[0])
    with d.client(namespace="tenant-b", token=TOKEN_B) as b:
        b.put(key("mine", 0), b"b's own" * 100, StateDescriptor("tenant-b", "m", "r"))
        # Another tenant's namespace cannot be opened: wrong token, no token, or an unlisted one.
        for ns, token, match in [("tenant-a", TOKEN_B, "token given is wrong"), ("tenant-a", None, "no token"),
                                 ("tenant-c", None, "auth.unlisted")]:
            with pytest.raises(PermissionDenied, match=match):
                b._run(b.core.op_simple(m.OpenNamespace(ns, token)))
        # Ops naming tenant-a on b's connection are refused before they touch anything.
        ids = tuple(secrets)
        for msg in [m.Get("tenant-a", secrets[1]), m.Lookup("tenant-a", ids), m.Delete("tenant-a", ids),
                    m.Pin("tenant-a", ids, 60.0), m.Unpin("tenant-a", ids), m.Prefetch("tenant-a", ids),
                    m.Reserve("tenant-a", key("forged", 0), 4096, desc)]:
            with pytest.raises(PermissionDenied, match="not open"):
                b._run(b.core.op_simple(msg))
        # a's ids in b's own namespace name nothing: ids are per namespace
        assert b.lookup(secrets).hits == 0 and b.get(secrets[1]) is None
        assert b.delete(secrets) == 0 and b.pin(secrets, ttl_s=60) == 0 and b.prefetch(secrets) == 0
        # a's lease ids are not b's to end (ids are small integers: easy to guess)
        for op in (m.Release(held.lease_id), m.Abort(held.lease_id)):
            with pytest.raises(NotFound):
                b._run(b.core.op_simple(op))
        with pytest.raises(NotFound):  # commit_many fails that item, with the same NotFound
            commit_one(b, held.lease_id, b"\0" * 16)
        # With auth configured a client's stats show only its own namespaces and leases.
        stats = b.stats()
        assert stats["scoped"] and set(stats["namespaces"]) == {"tenant-b"} and stats["leases"] == 0
    assert a.stats()["leases"] == 1
    held.release()
    for k in secrets:  # every byte as a put it, nothing pinned or deleted by b
        with a.get(k) as lease:
            assert np.array_equal(lease.numpy(), content(k, size_of(k)))
        doc = d.admin().get(f"/v1/objects/{k.hex}", namespace="tenant-a")
        assert not doc["pinned"] and doc["hints"]["ttl_s"] is None
    assert a.stats()["namespaces"]["tenant-a"]["num_deletes"] == 0
    assert_clean(d, a)
    a.close()


def test_a_client_receives_only_the_arena_fds_it_may_use(make_daemon):
    d = make_daemon(extra_toml=AUTH)
    refused, fds = open_raw(d.socket, "tenant-a", TOKEN_B)
    assert refused.error["code"] == "permission_denied" and fds == []
    arenas = {}
    for ns, token in (("tenant-a", TOKEN_A), ("tenant-b", TOKEN_B)):
        reply, fds = open_raw(d.socket, ns, token)
        assert reply.ok and len(fds) == 1
        # one memfd per tenant: its own file (inode), named after the tenant
        assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith(f"/memfd:kvstore-{ns}")
        arenas[ns] = os.fstat(fds[0]).st_ino
        os.close(fds[0])
    assert arenas["tenant-a"] != arenas["tenant-b"]


def test_a_tenant_receives_only_its_own_shared_index_and_can_only_read_it(make_daemon):
    d = make_daemon(extra_toml=AUTH)
    secret = key("secret", 0)
    with d.client(namespace="tenant-a", token=TOKEN_A) as a:
        a.put(secret, content(secret, 4096), StateDescriptor("tenant-a", "m", "r"))
    refused, fds = open_raw(d.socket, "tenant-a", TOKEN_B, index=True)
    assert refused.error["code"] == "permission_denied" and fds == []
    indexes = {}
    for ns, token in (("tenant-a", TOKEN_A), ("tenant-b", TOKEN_B)):
        reply, fds = open_raw(d.socket, ns, token, index=True)
        assert reply.ok and len(fds) == 2 and reply.result["index_bytes"] > 0
        assert os.readlink(f"/proc/self/fd/{fds[1]}").startswith(f"/memfd:kvstore-index-{ns}")
        indexes[ns] = os.fstat(fds[1]).st_ino
        with pytest.raises(PermissionError):  # sealed: only the daemon writes it
            mmap.mmap(fds[1], reply.result["index_bytes"], flags=mmap.MAP_SHARED)
        for fd in fds:
            os.close(fd)
    assert indexes["tenant-a"] != indexes["tenant-b"]
    with d.client(namespace="tenant-b", token=TOKEN_B) as b:
        b.put(key("mine", 0), b"b's own" * 100, StateDescriptor("tenant-b", "m", "r"))
        assert b.get(secret) is None and b.get_into(secret, np.empty(4096, np.uint8)) is None
        with pytest.raises(PermissionDenied, match="token given is wrong"):  # its open is refused
            b.get_into(secret, np.empty(4096, np.uint8), namespace="tenant-a")
        assert set(b.core.arenas) == {"tenant-b"} and b.core.shared.wanted


def test_admin_api_is_operator_scope_and_tenant_tokens_are_not_admin_tokens(make_daemon):
    d = make_daemon(extra_toml=AUTH)
    for ns, token in (("tenant-a", TOKEN_A), ("tenant-b", TOKEN_B)):
        with d.client(namespace=ns, token=token) as c:
            c.put(key(ns, 0), b"x" * 4096, StateDescriptor(ns, "m", "r"))
    api = d.admin()
    listed = {o["namespace"] for o in api.get("/v1/objects")["objects"]}
    assert listed == {"tenant-a", "tenant-b"}  # documented: the operator token sees everyone
    for token in (TOKEN_A, None, api.token[:-1]):
        with pytest.raises(AdminRequestFailed) as exc:
            type(api)(api.url, token).get("/v1/objects")
        assert exc.value.status == 401


def _as_uid(uid: int, fn) -> object:
    """Run fn() in a forked child that dropped to `uid`; its JSON-able result comes back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no imports, no threads, just the socket calls in fn
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result = f"{type(exc).__name__}: {exc}"
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)


def _open_as(path, ns):
    reply, fds = open_raw(path, ns)
    return [reply.error["code"] if reply.error else "ok", len(fds)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_other_users_are_kept_out_by_file_modes_and_uid_rules(make_daemon):
    nobody = 65534
    d = make_daemon({"nvme": nvme()})
    os.chmod(d.root, 0o711)  # let other users reach the socket's directory: the socket's own mode must stop them
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d.data_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(d.data_dir, "admin.token")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(d.data_dir, "nvme")).st_mode) == 0o700
    assert "PermissionError" in _as_uid(nobody, lambda: _open_as(d.socket, "default"))

    # A socket opened to everyone on purpose: uid rules (from SO_PEERCRED) still decide.
    mine, theirs = os.getuid(), nobody
    rules = f'[auth.namespaces.mine]\nuids = [{mine}]\n[auth.namespaces.theirs]\nuids = [{theirs}]\n'
    shared = make_daemon({"socket_mode": 0o666}, rules)
    os.chmod(shared.root, 0o711)
    assert _as_uid(nobody, lambda: _open_as(shared.socket, "mine")) == ["permission_denied", 0]
    assert _as_uid(nobody, lambda: _open_as(shared.socket, "theirs")) == ["ok", 1]
    assert _open_as(shared.socket, "theirs") == ["permission_denied", 0]
    assert _open_as(shared.socket, "mine") == ["ok", 1]


def test_what_the_daemon_makes_is_private_and_a_readable_data_dir_keeps_its_mode(make_daemon, tmp_path):
    nvme_dir = tmp_path / "elsewhere" / "tier"
    d = make_daemon({"nvme": nvme(path=str(nvme_dir))}, start=False)
    os.makedirs(d.data_dir, mode=0o755)
    os.chmod(d.data_dir, 0o755)  # made by hand before the first start: used, never chmodded
    d.start()
    assert stat.S_IMODE(os.stat(d.data_dir).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(os.path.join(d.data_dir, "admin.token")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(d.data_dir, LOCK_FILE)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(nvme_dir).st_mode) == 0o700  # the index names every tenant's objects
    with d.client() as c:
        c.put(key("perm", 0), content(key("perm", 0), MiB))
        assert_clean(d, c)


def _impostor(path: str, uid: int, ready_w: int, report_w: int) -> int:
    """A fork that drops to `uid`, listens at `path`, and reports the bytes each client sent."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(4)
        os.write(ready_w, b"1")
        received = []
        server.settimeout(5)
        try:
            while True:
                conn, _ = server.accept()
                conn.settimeout(1)
                try:
                    received.append(len(conn.recv(65536)))
                except OSError:
                    received.append(-1)
                conn.close()
        except OSError:  # no more clients
            pass
        os.write(report_w, json.dumps(received).encode())
    finally:
        os._exit(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_client_sends_nothing_to_a_server_of_another_user(monkeypatch):
    """Another uid that can write the socket's directory moves the socket aside and listens
    at the path: the client must notice (SO_PEERCRED) before its hello, sync and asyncio."""
    import asyncio

    from kvstore.client import AsyncClient, Client
    from kvstore.errors import DaemonUnavailable, KVStoreError
    nobody = 65534
    shared = tempfile.mkdtemp(prefix="kvs-")  # pytest's tmp_path sits under a 0700 directory
    os.chmod(shared, 0o777)
    path = os.path.join(shared, "kvstore.sock")
    ready_r, ready_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = _impostor(path, nobody, ready_w, report_w)
    os.close(ready_w)  # the child's copies only: a child that fails reads as EOF, not a hang
    os.close(report_w)
    assert os.read(ready_r, 1) == b"1", "the impostor could not listen"
    with pytest.raises(PermissionDenied, match=f"runs as uid {nobody}.*KVSTORE_DAEMON_UID={nobody}"):
        Client.connect(path, timeout_s=2)
    with pytest.raises(PermissionDenied, match=f"runs as uid {nobody}"):
        asyncio.run(AsyncClient.connect(path, timeout_s=2))
    monkeypatch.setenv("KVSTORE_DAEMON_UID", "12, x")
    with pytest.raises(InvalidArgument, match="KVSTORE_DAEMON_UID"):
        Client.connect(path, timeout_s=2)
    monkeypatch.setenv("KVSTORE_DAEMON_UID", str(nobody))  # trusted on purpose: the hello goes out
    with pytest.raises(KVStoreError) as err:
        Client.connect(path, timeout_s=2)
    assert isinstance(err.value, DaemonUnavailable)
    os.waitpid(pid, 0)
    sent = json.loads(os.read(report_r, 256) or b"null")
    assert sent is not None and sent[:3] == [0, 0, 0] and sent[3] > 0, sent  # only the trusted one spoke
    shutil.rmtree(shared, ignore_errors=True)
