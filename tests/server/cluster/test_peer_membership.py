"""Membership: the static list, and live members in a real etcd started by the test."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from peer_helpers import etcd_server, run

from kvstore.server.cluster.membership import EtcdMembership, StaticMembership

TTL_S = 2.0
# Lease expiry is checked by etcd about every 0.5 s; the watch then tells us at once.
NOTICE_MARGIN_S = 3.0  # generous: a loaded CI machine delays etcd and us alike

_MEMBER = """
import asyncio, sys
from kvstore.server.cluster.membership import EtcdMembership
async def main():
    m = EtcdMembership(sys.argv[1], "/t/", sys.argv[2], sys.argv[3], ttl_s=float(sys.argv[4]))
    await m.start()
    print("registered", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with etcd_server(str(tmp_path_factory.mktemp("etcd"))) as url:
        yield url


def test_static_membership_includes_itself_and_reports_once():
    seen = []
    m = StaticMembership("a", "10.0.0.1:8471", {"b": "10.0.0.2:8471"}, on_change=seen.append)
    run(m.start())
    assert m.members() == {"a": "10.0.0.1:8471", "b": "10.0.0.2:8471"}
    assert seen == [m.members()]


async def _wait_for(predicate, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def _spawn_member(etcd, node_id, address, ttl_s=TTL_S):
    proc = subprocess.Popen([sys.executable, "-c", _MEMBER, etcd, node_id, address, str(ttl_s)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": "."})
    assert proc.stdout.readline().strip() == "registered"
    return proc


def test_members_see_each_other_and_a_killed_node_leaves_within_the_ttl(etcd):
    changes = []

    async def scenario():
        a = EtcdMembership(etcd, "/t/", "a", "10.0.0.1:1", ttl_s=TTL_S, on_change=changes.append)
        await a.start()
        proc = await asyncio.to_thread(_spawn_member, etcd, "b", "10.0.0.2:1")
        try:
            await _wait_for(lambda: "b" in a.members(), 10.0)
            assert a.members() == {"a": "10.0.0.1:1", "b": "10.0.0.2:1"}
            proc.send_signal(signal.SIGKILL)  # no revoke: only the lease running out tells
            noticed = await _wait_for(lambda: "b" not in a.members(), TTL_S + NOTICE_MARGIN_S)
        finally:
            proc.kill()
            proc.wait()
            await a.stop()
        return noticed

    noticed = run(scenario())
    assert noticed <= TTL_S + NOTICE_MARGIN_S
    assert changes[-1] == {"a": "10.0.0.1:1"} and any("b" in c for c in changes)


def test_a_member_restarted_within_its_lease_is_reported_gone_and_back(etcd):
    """b killed and started again long before its lease runs out: its key never goes away,
    yet a must see it leave and join (b came back empty; re-homing keys off that)."""
    ttl_s = 30.0  # far longer than the restart: the key is never dropped
    changes = []

    async def scenario():
        a = EtcdMembership(etcd, "/t/", "a", "10.0.0.1:1", ttl_s=ttl_s, on_change=changes.append)
        await a.start()
        procs = [await asyncio.to_thread(_spawn_member, etcd, "b", "10.0.0.2:1", ttl_s)]
        try:
            await _wait_for(lambda: "b" in a.members(), 10.0)
            procs[0].send_signal(signal.SIGKILL)
            del changes[:]
            procs.append(await asyncio.to_thread(_spawn_member, etcd, "b", "10.0.0.2:1", ttl_s))
            await _wait_for(lambda: len(changes) >= 2, 10.0)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            await a.stop()

    run(scenario(), timeout_s=60)
    both = {"a": "10.0.0.1:1", "b": "10.0.0.2:1"}
    assert changes == [{"a": "10.0.0.1:1"}, both]


def test_graceful_stop_leaves_at_once(etcd):
    ttl_s = 30.0  # far longer than any wait below: b is gone because it revoked, not expired

    async def scenario():
        a = EtcdMembership(etcd, "/g/", "a", "10.0.0.1:1", ttl_s=ttl_s)
        b = EtcdMembership(etcd, "/g/", "b", "10.0.0.2:1", ttl_s=ttl_s)
        await a.start()
        await b.start()
        await _wait_for(lambda: set(a.members()) == {"a", "b"}, 10.0)
        await b.stop()
        try:
            return await _wait_for(lambda: set(a.members()) == {"a"}, ttl_s / 3)
        finally:
            await a.stop()

    assert run(scenario(), timeout_s=60) < 30.0 / 3


def test_lost_lease_is_registered_again(etcd):
    """etcd forgets a lease (restart, long pause): the member puts itself back."""
    async def scenario():
        a = EtcdMembership(etcd, "/l/", "a", "10.0.0.1:1", ttl_s=TTL_S)
        b = EtcdMembership(etcd, "/l/", "b", "10.0.0.2:1", ttl_s=TTL_S)
        await a.start()
        await b.start()
        old = b.lease_id
        body = json.dumps({"ID": old}).encode()
        await asyncio.to_thread(urllib.request.urlopen, f"{etcd}/v3/lease/revoke", body, 2)
        await _wait_for(lambda: "b" not in a.members(), 10.0)
        await _wait_for(lambda: "b" in a.members(), 10.0)
        new = b.lease_id
        await b.stop()
        await a.stop()
        return old, new

    old, new = run(scenario())
    assert old != new


def test_unreachable_etcd_fails_start_clearly():
    from kvstore.errors import ServiceError

    m = EtcdMembership("http://127.0.0.1:9", "/x/", "a", "10.0.0.1:1", timeout_s=0.5)
    with pytest.raises(ServiceError, match="etcd at http://127.0.0.1:9 failed"):
        run(m.start())
