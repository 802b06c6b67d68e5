"""Per-client resource limits: each configurable, enforced, and refused with an error that
names the limit; one greedy client cannot starve another.

Covered elsewhere: leases per client (tests/server/test_daemon.py::test_lease_quota_per_client),
oversized frames on the default limit (test_daemon.py::test_garbage_on_the_socket...).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvstore.client import AsyncClient, DaemonUnavailable
from hardening_support import CHILD_ENV, HERE, MiB, assert_clean, content, key, rss_bytes
from kvs_testing import commit_one
from kvstore import StateDescriptor
from kvstore import messages as m
from kvstore.config import ServerConfig
from kvstore.errors import InvalidArgument, LimitExceeded
from kvstore.groups import Member
from kvstore.protocol import FrameCodec, Reply, Request


@pytest.mark.parametrize("limits, match", [
    ({"max_inflight_bytes_per_client": 0}, "max_inflight_bytes_per_client"),
    ({"max_inflight_bytes_per_client": "lots"}, r"limits\.max_inflight_bytes_per_client must be a size"),
    ({"max_frame_bytes": "1KiB"}, "max_frame_bytes"),
    ({"max_frame_bytes": "1GiB"}, "max_frame_bytes"),
    ({"max_clients": 0}, "max_clients"),
    # issue 41 item 16: limits the daemon took and then refused every put (or read) under
    ({"max_inflight_bytes_per_client": 1}, r"limits\.max_inflight_bytes_per_client must be an integer >= 1048576 "
                                           r"\(no put of an object larger than it can be stored\), got 1"),
    ({"max_inflight_bytes_per_client": "1023KiB"}, r"limits\.max_inflight_bytes_per_client must be .* >= 1048576"),
    ({"max_leases_per_client": 1}, r"limits\.max_leases_per_client must be an integer >= 2 \(a store group"),
    ({"lease_ttl_s": 0.001}, r"limits\.lease_ttl_s must be a number of seconds >= 1 \(a reader's lease"),
])
def test_bad_limits_are_refused_with_the_key_named(limits, match):
    with pytest.raises(InvalidArgument, match=match):
        ServerConfig.from_dict({"limits": limits})


def test_the_least_limits_accepted_leave_a_daemon_that_stores_and_reads(make_daemon):
    """Issue 41 item 16: the floors are where a daemon still does what every client needs."""
    least = {"max_clients": 1, "max_leases_per_client": 2, "max_inflight_bytes_per_client": "1MiB", "lease_ttl_s": 1}
    d = make_daemon({"limits": least})
    big, small = key("least", 0), key("least", 1)
    with d.client() as c:
        assert c.put(big, content(big, MiB)).error is None  # an object as large as the limit
        out = np.empty(MiB, np.uint8)
        assert c.get_into(big, out) == MiB and np.array_equal(out, content(big, MiB))
        desc = StateDescriptor("default", "m", "r")
        assert not c.put_group([(small, content(small, 64 << 10), desc)]).existed  # member + manifest leases
        with c.get_group([Member(small, desc)]) as group:
            assert bytes(group[0].buffer) == bytes(content(small, 64 << 10))
        with pytest.raises(LimitExceeded, match=r"limits\.max_inflight_bytes_per_client \(1048576\)"):
            c.put(key("least", 2), content(big, MiB + 4096))


def test_the_client_past_max_clients_is_refused_by_name_and_the_rest_keep_working(make_daemon):
    d = make_daemon({"limits": {"max_clients": 3}})
    clients = [d.client() for _ in range(3)]
    with pytest.raises(DaemonUnavailable, match=r"at most 3 clients \(limits.max_clients\)"):
        d.client()
    with pytest.raises(DaemonUnavailable, match=r"limits.max_clients"):
        asyncio.run(AsyncClient.connect(d.socket))
    raw = socket.socket(socket.AF_UNIX)  # what the refused connection receives, on the wire
    raw.connect(d.socket)
    codec = FrameCodec()
    codec.receive_data(b"".join(iter(lambda: raw.recv(4096), b"")))
    reply = codec.next_event()
    assert isinstance(reply, Reply) and reply.error["code"] == "limit_exceeded"
    raw.close()
    for i, c in enumerate(clients):
        c.put(key("clients", i), b"x" * 100)
    clients.pop().close()
    late = d.client()  # a slot freed: the next client gets in
    assert late.lookup([key("clients", i) for i in range(3)]).hits == 3
    assert_clean(d, late, expect_clients=3)


def test_inflight_bytes_per_client_are_capped_with_a_clear_error(make_daemon):
    d = make_daemon({"limits": {"max_inflight_bytes_per_client": "2MiB"}})
    desc = StateDescriptor("default", "m", "r")
    with d.client() as c:
        assert c.server_info.limits.max_inflight_bytes == 2 * MiB
        c._run(c.core.op_open("default"))
        reserve = lambda i, size: c._run(c.core.op_simple(m.Reserve("default", key("inflight", i), size, desc)))  # noqa: E731
        first = reserve(0, 1536 * 1024)
        with pytest.raises(LimitExceeded, match=r"limits.max_inflight_bytes_per_client \(2097152\)"):
            reserve(1, MiB)
        c._run(c.core.op_simple(m.Abort(first.lease)))
        second = reserve(1, MiB)  # aborting gave the bytes back
        commit_one(c, second.lease, b"\0" * 16)
        reserve(2, 2 * MiB)  # and so did committing
        with pytest.raises(LimitExceeded, match="max_inflight_bytes_per_client"):
            c.put(key("inflight", 3), np.zeros(3 * MiB, np.uint8))  # more than the limit alone
    with d.client() as c:  # the dead connection's reservation went with it
        # put_many keeps its window under the daemon's limit, so a batch far larger goes through
        items = [(key("window", i), content(key("window", i), MiB)) for i in range(8)]
        assert all(r.error is None for r in c.put_many(items))
        assert c.lookup([k for k, _ in items]).hits == 8
        assert_clean(d, c)


def test_a_hoarding_client_cannot_starve_another(make_daemon):
    d = make_daemon({"limits": {"max_leases_per_client": 8, "max_inflight_bytes_per_client": "4MiB"}})
    with d.client() as c:
        hoarded = [key("hoard", i) for i in range(8)]
        for k in hoarded:
            c.put(k, content(k, MiB))
        hoarder = subprocess.Popen([sys.executable, os.path.join(HERE, "workers.py"), "hoard", d.socket, "8"],
                                   stdout=subprocess.PIPE, text=True, env=CHILD_ENV)
        try:
            held = json.loads(hoarder.stdout.readline())
            # It got what the limits allow and no more, and was told which limit stopped it.
            assert held["reserved"] == 4 and "max_inflight_bytes_per_client" in held["reserve_error"]
            assert held["read_leases"] == 4 and "max_leases_per_client" in held["lease_error"]
            assert d.admin().get("/v1/stats")["leases"] == 8
            # 16 MiB arena, 8 MiB of it held by the hoarder: the other client still puts a working
            # set three times the arena and reads back what it just wrote.
            mine = [key("mine", i) for i in range(48)]
            for k in mine:
                c.put(k, content(k, MiB))
            for k in mine[-4:]:
                out = np.empty(MiB, np.uint8)
                assert c.get_into(k, out) == MiB and np.array_equal(out, content(k, MiB))
        finally:
            hoarder.kill()
            hoarder.wait(10)
        assert_clean(d, c)


def test_frame_limit_is_configurable_and_named_when_hit(make_daemon):
    d = make_daemon({"limits": {"max_frame_bytes": "256KiB"}})
    with d.client() as c:
        assert c.server_info.limits.max_frame_bytes == 256 * 1024
        keys = [key("frame", i) for i in range(4096)]
        assert c.lookup(keys).hits == 0  # the largest batch (~140 KiB) still fits
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(d.socket)
        raw.sendall(struct.pack("<I", 256 * 1024 + 1) + b"\0" * 64)
        data = b"".join(iter(lambda: raw.recv(4096), b""))
        raw.close()
        codec = FrameCodec()
        codec.receive_data(data)
        reply = codec.next_event()
        assert reply.error["code"] == "protocol" and "limits.max_frame_bytes" in reply.error["message"]
        assert_clean(d, c)


def test_a_client_that_never_reads_cannot_grow_the_daemon(make_daemon):
    """Regression: replies to a client that only sends were buffered without bound (+190 MiB
    for 400k pipelined stats requests). Now the daemon stops reading that client instead."""
    d = make_daemon()
    before = rss_bytes(d.pid)
    flood = socket.socket(socket.AF_UNIX)
    flood.connect(d.socket)
    flood.setblocking(False)
    codec = FrameCodec()
    frame = codec.send_request(Request(7, "stats", {}))
    batch = frame * 1000
    sent, stalls = 0, 0
    while sent < 400 * len(batch) and stalls < 300:
        try:
            sent += flood.send(batch[sent % len(batch):])
            stalls = 0
        except BlockingIOError:
            stalls += 1
            threading.Event().wait(0.01)
    assert rss_bytes(d.pid) - before < 64 * MiB
    with d.client() as c:  # the flooded daemon still serves everyone else
        c.put(key("flood", 0), b"still here")
        assert c.lookup([key("flood", 0)]).hits == 1
    # Every request it did accept is answered, in order, once the client reads.
    flood.setblocking(True)
    flood.settimeout(30)
    rest = -sent % len(frame)
    sender = threading.Thread(target=flood.sendall, args=(batch[sent % len(batch):][:rest],))
    sender.start()
    expected, got = (sent + rest) // len(frame), 0
    reader = FrameCodec()
    while got < expected:
        reader.receive_data(flood.recv(1 << 20))
        while isinstance(event := reader.next_event(), Reply):
            assert event.ok and event.id == 7
            got += 1
    sender.join()
    flood.close()
    with d.client() as c:
        assert_clean(d, c)
