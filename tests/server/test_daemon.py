"""A real daemon process and a real client over the real Unix socket."""

import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import xxhash

from kvstore.client import DaemonUnavailable
from kvstore import Hints, StateDescriptor, chunk_keys
from kvstore.errors import CapacityError, ChecksumError, InvalidArgument, LimitExceeded, PermissionDenied
from kvstore.identity import ObjectId
from kvstore.protocol import FrameCodec, Reply, Request
from kvs_testing import commit_one, payload, sent_ops, wait_for

MiB = 1 << 20


def ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return [ObjectId(rng.bytes(32)) for _ in range(n)]


def test_put_get_integrity_across_input_types(daemon):
    with daemon.client() as c:
        keys = ids(6)
        inputs = [
            b"\x01" * 4096,
            bytearray(payload(70_000, 1).tobytes()),
            payload(1 * MiB + 3, 2),
            torch.arange(100_000, dtype=torch.bfloat16),
            torch.randn(3, 1000, dtype=torch.float32),
            memoryview(payload(5000, 3)),
        ]
        for key, data in zip(keys, inputs):
            assert not c.put(key, data).existed
        for key, data in zip(keys, inputs):
            expected = np.ascontiguousarray(data.view(torch.uint8).reshape(-1).numpy() if isinstance(data, torch.Tensor)
                                            else np.frombuffer(memoryview(data).cast("B"), np.uint8))
            with c.get(key) as lease:
                assert lease.size == expected.size and lease.verify()
                assert xxhash.xxh3_128_digest(lease.buffer) == xxhash.xxh3_128_digest(expected)
            out = np.zeros(expected.size + 10, dtype=np.uint8)
            assert c.get_into(key, out, verify=True) == expected.size
            assert np.array_equal(out[:expected.size], expected)
        c.check_integrity()


def test_tensor_of_a_lease_is_a_copy_and_numpy_the_zero_copy_view(daemon):
    with daemon.client() as c:
        key = ids(1)[0]
        c.put(key, torch.arange(1024, dtype=torch.float32))
        with c.get(key) as lease:
            t = lease.tensor(torch.float32)  # torch has no read-only tensors: the caller's copy
            assert torch.equal(t, torch.arange(1024, dtype=torch.float32))
            assert t.data_ptr() != lease.numpy().ctypes.data
            assert lease.numpy().ctypes.data == np.frombuffer(lease.buffer, np.uint8).ctypes.data


def test_same_id_is_stored_once(daemon):
    with daemon.client() as c:
        key = ids(1)[0]
        assert not c.put(key, b"a" * 100).existed
        assert c.put(key, b"a" * 100).existed
        assert c.stats()["namespaces"]["default"]["num_dedup_puts"] == 1


def test_eviction_under_capacity_pressure_keeps_newest(daemon_factory):
    d = daemon_factory("8MiB")
    with d.client() as c:
        keys = ids(40)
        for i, key in enumerate(keys):
            c.put(key, payload(MiB, i))
        found = c.lookup(keys[-4:])
        assert found.hits == 4
        stats = c.stats()["namespaces"]["default"]
        assert stats["num_evictions"] >= 32 and stats["used_bytes"] <= 8 * MiB
        for i, key in enumerate(keys):  # whatever is still there is intact
            out = np.empty(MiB, np.uint8)
            if c.get_into(key, out):
                assert np.array_equal(out, payload(MiB, i))
        c.check_integrity()


def test_pins_are_never_evicted_and_unpin_releases(daemon_factory):
    d = daemon_factory("8MiB")
    with d.client() as c:
        pinned = ids(3, seed=1)
        for i, key in enumerate(pinned):
            c.put(key, payload(MiB, i), hints=Hints(pin=True) if i == 0 else None)
        assert c.pin(pinned[1:]) == 2
        for i, key in enumerate(ids(30, seed=2)):
            c.put(key, payload(MiB, 100 + i))
        assert c.lookup(pinned).hits == 3
        assert c.unpin(pinned) == 3
        for i, key in enumerate(ids(30, seed=3)):
            c.put(key, payload(MiB, 200 + i))
        assert c.lookup(pinned[:1]).hits == 0


def test_a_lookup_that_pins_keeps_what_it_found_through_eviction(daemon_factory):
    """lookup(pin_ttl_s=...) pins in the lookup's round trip: what it found survives a flood
    that evicts everything else; a key it did not find is not pinned; a bad ttl is refused."""
    d = daemon_factory("8MiB")
    with d.client() as c:
        found, missing = ids(2, seed=4), ids(1, seed=5)
        for i, key in enumerate(found):
            c.put(key, payload(MiB, i))
        assert c.lookup(found + missing, pin_ttl_s=60).tiers == ("host", "host", None)
        for i, key in enumerate(ids(30, seed=6)):
            c.put(key, payload(MiB, 100 + i))
        assert c.lookup(found).hits == 2
        assert c.unpin(found + missing) == 2
        for bad in (0, -1, float("inf"), 10 ** 12):
            with pytest.raises(InvalidArgument):
                c.lookup(found, pin_ttl_s=bad)


def test_capacity_exhaustion_is_a_clear_error_and_nothing_is_lost(daemon_factory):
    d = daemon_factory("4MiB")
    with d.client() as c:
        keys = ids(4)
        for i, key in enumerate(keys):
            c.put(key, payload(MiB - 4096, i), hints=Hints(pin=True))
        with pytest.raises(CapacityError, match="pinned, leased"):
            c.put(ids(1, seed=9)[0], payload(MiB, 9))
        with pytest.raises(CapacityError, match="larger than"):
            c.put(ids(1, seed=10)[0], payload(5 * MiB, 9))
        for i, key in enumerate(keys):
            out = np.empty(MiB - 4096, np.uint8)
            assert c.get_into(key, out) and np.array_equal(out, payload(MiB - 4096, i))
        c.check_integrity()


def test_leased_object_survives_delete_until_released(daemon):
    with daemon.client() as c:
        key = ids(1)[0]
        c.put(key, payload(100_000, 1))
        lease = c.get(key)
        assert c.delete([key]) == 1
        assert c.get(key) is None
        assert np.array_equal(lease.numpy(), payload(100_000, 1))  # still ours to read
        c.put(ids(1, seed=5)[0], payload(100_000, 2))  # cannot land on the leased extent
        assert np.array_equal(lease.numpy(), payload(100_000, 1))
        lease.release()
        c.check_integrity()
        assert c.stats()["leases"] == 0


_HOLDER = r"""
import sys, time
from kvstore.client import Client
from kvstore.identity import ObjectId
from kvstore.messages import Reserve
from kvstore import StateDescriptor
c = Client.connect(sys.argv[1])
leases = [c.get(ObjectId(bytes.fromhex(h))) for h in sys.argv[2:]]
assert all(leases)
# an uncommitted put: a write lease on 1 MiB that only the daemon can take back
c._run(c.core.op_simple(Reserve("default", ObjectId(b"\x07" * 32), 1 << 20, StateDescriptor("default", "m", "r"))))
print("holding", flush=True)
time.sleep(600)
"""


def test_lease_released_when_client_dies(daemon_factory):
    d = daemon_factory("4MiB")
    with d.client() as c:
        keys = ids(3)
        for i, key in enumerate(keys):
            c.put(key, payload(MiB - 4096, i))
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, d.socket, *[k.hex for k in keys]],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert holder.stdout.readline().strip() == "holding"
        assert c.stats()["leases"] == 4
        with pytest.raises(CapacityError):  # everything is leased: nothing to evict
            c.put(ids(1, seed=7)[0], payload(2 * MiB, 7))
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert wait_for(lambda: c.stats()["leases"] == 0)
        c.check_integrity()
        c.put(ids(1, seed=7)[0], payload(2 * MiB, 7))  # the dead client's extents are reusable
        assert c.stats()["clients"] == 1


def test_lease_expires_when_client_never_releases(daemon_factory):
    d = daemon_factory(config={"limits": {"lease_ttl_s": 2.0}})
    with d.client(shared_index=False) as c:  # every get a daemon lease (small ones are copies otherwise)
        key = ids(1)[0]
        c.put(key, b"x" * 10)
        c.get(key)  # never released
        assert c.stats()["leases"] == 1
        assert wait_for(lambda: c.stats()["leases"] == 0, timeout=10)
        c.check_integrity()


def test_pins_extend_never_shorten_and_expired_pins_are_not_unpinned(daemon):
    with daemon.client() as c:
        forever, brief = ids(2, seed=9)
        c.put(forever, b"f" * 100)
        c.put(brief, b"b" * 100)
        assert c.pin([forever]) == 1 and c.pin([forever], ttl_s=0.05) == 1  # the second must not shorten it
        assert c.pin([brief], ttl_s=0.05) == 1
        with pytest.raises(InvalidArgument, match="ttl_s must be > 0 seconds"):  # refused before it is sent
            c.pin([brief], ttl_s=0)
        time.sleep(0.1)
        assert c.unpin([forever, brief]) == 1  # only the pin still in force counts
        assert c.unpin([forever]) == 0


def test_lease_quota_per_client(daemon_factory):
    d = daemon_factory(config={"limits": {"max_leases_per_client": 3}})
    with d.client(shared_index=False) as c, d.client(shared_index=False) as other:  # daemon leases, as above
        key = ids(1)[0]
        c.put(key, b"x" * 10)
        held = [c.get(key) for _ in range(3)]
        with pytest.raises(LimitExceeded, match="max_leases_per_client"):
            c.get(key)
        assert other.get(key) is not None  # one greedy client does not starve the rest
        held[0].release()
        assert c.get(key) is not None


def test_namespaces_cannot_see_each_other(daemon):
    tokens = list(range(512))
    desc_a = StateDescriptor("tenant-a", "m", "r")
    with daemon.client(namespace="tenant-a") as a, daemon.client(namespace="tenant-b") as b:
        keys_a = chunk_keys(tokens, desc_a)
        for k in keys_a:
            a.put(k, b"secret" * 100, desc_a)
        # Even knowing A's ids, B's namespace does not hold them.
        assert b.lookup(keys_a).hits == 0
        assert b.get(keys_a[0]) is None
        assert b.delete(keys_a) == 0 and b.pin(keys_a) == 0
        assert a.lookup(keys_a).hits == 2
        # A connection that never opened tenant-a cannot touch it.
        with pytest.raises(PermissionDenied, match="not open"):
            b._run(b.core.op_simple(__import__("kvstore.messages", fromlist=["Lookup"]).Lookup("tenant-a", tuple(k.object_id for k in keys_a))))
        stats = a.stats()["namespaces"]
        assert stats["tenant-a"]["objects"] == 2 and "tenant-b" not in stats  # B only read: no arena


def test_layout_size_mismatch_is_refused(daemon):
    from kvstore import messages as m
    desc = StateDescriptor("default", "m", "r", "kv", "bf16", "paged(order=layer_first,layers=2,block=16,kv_heads=1,head_dim=8)", chunk_tokens=16)
    with daemon.client() as c:
        c.put(ids(2)[1], b"y" * desc.object_bytes, desc)  # the namespace is open
        sent = sent_ops(c)
        with pytest.raises(InvalidArgument, match="does not match its layout"):
            c.put(ids(1)[0], b"x" * 100, desc)
        assert sent == []  # the client refused it before sending anything
        # and the daemon refuses it too, for a client that does not check: as a reserve and inline
        reply = c._run(c.core.op_simple(m.ReserveMany.of("default", [ids(1)[0]], [100], desc)))
        assert "does not match its layout" in str(reply.errors)
        with pytest.raises(InvalidArgument, match="object of 100 bytes does not match its layout"):
            c._run(c.core.op_simple(m.PutInline("default", ids(1)[0], desc, b"x" * 100, Hints(), "host")))
        assert c.lookup(ids(1)).hits == 0
        c.put(ids(1)[0], b"x" * desc.object_bytes, desc)


def test_commit_with_wrong_checksum_stores_nothing(daemon_factory):
    daemon = daemon_factory(config={"verify_puts": True})
    from kvstore import messages as m
    with daemon.client() as c:
        key = ids(1)[0]
        c._run(c.core.op_open("default"))
        r = c._run(c.core.op_simple(m.Reserve("default", key, 100, StateDescriptor("default", "m", "r"))))
        c.core.arenas["default"][r.offset:r.offset + 100] = 7
        with pytest.raises(ChecksumError, match="do not match"):
            commit_one(c, r.lease, b"\x00" * 16)
        assert c.get(key) is None
        assert c.stats()["namespaces"]["default"]["num_checksum_failures"] == 1
        c.check_integrity()


def test_lookup_of_1024_keys_counts_leading_hits(daemon):
    with daemon.client() as c:
        keys = ids(1024)
        c.put_many([(k, b"z" * 64) for k in keys[:500]])
        c.put(keys[700], b"z" * 64)
        found = c.lookup(keys)
        assert found.hits == 500 and found.tiers[700] == "host" and found.tiers[600] is None
        assert found.hit_bytes == 500 * 64 and found.est_load_s > 0


def test_a_lookup_in_either_wire_form_gets_the_same_answer(daemon):
    """A client from before the packed form sends its ids as a list of bins and reads the
    tiers as names; today's sends them packed and asks for the tiers as codes. Both hear
    the same."""
    def raw(core, args: dict):
        (reply,) = yield [Request(next(core._ids), "lookup", args)]
        return reply

    with daemon.client() as c:
        keys = ids(300)
        c.put_many([(k, b"z" * 64) for k in keys[:200]])
        c.put(keys[250], b"z" * 64)
        asked = [bytes(k) for k in keys]
        old = c._run(raw(c.core, {"namespace": "default", "ids": asked}))
        new = c._run(raw(c.core, {"namespace": "default", "ids": b"".join(asked), "codes": True}))
        assert old.error is None and new.error is None
        assert "codes" not in old.result and "codes" in new.result and new.result["tiers"] == []
        names = [None] * 300
        names[:200], names[250] = ["host"] * 200, "host"
        assert old.result["tiers"] == names
        assert new.result["codes"] == bytes(1 if name else 0 for name in names)
        assert {k: old.result[k] for k in ("hits", "hit_bytes")} == {k: new.result[k] for k in ("hits", "hit_bytes")}
        assert (old.result["hits"], old.result["hit_bytes"]) == (200, 200 * 64)
        assert c.lookup(keys).tiers == tuple(names)
        bad = c._run(raw(c.core, {"namespace": "default", "ids": b"\x00" * 33}))
        assert bad.error["code"] == "invalid_argument" and "multiple of 32 bytes" in bad.error["message"]
        assert c.lookup(keys).hits == 200  # the connection goes on


def test_garbage_on_the_socket_gets_errors_and_changes_nothing(daemon):
    with daemon.client() as c:
        key = ids(1)[0]
        c.put(key, b"keep" * 1000)
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(daemon.socket)
        codec = FrameCodec()
        raw.sendall(struct.pack("<I", 3) + b"\xc1\xc1\xc1" + codec.send_request(Request(5, "get", {"namespace": 1})))
        replies = []
        while len(replies) < 2:
            codec.receive_data(raw.recv(4096))
            while isinstance(ev := codec.next_event(), Reply):
                replies.append(ev)
        assert replies[0].error["code"] == "protocol" and replies[1].id == 5
        assert replies[1].error["code"] == "invalid_argument"
        raw.sendall(struct.pack("<I", 2**31) + b"x")  # unrecoverable: the daemon hangs up
        raw.settimeout(10)
        data = b""
        while chunk := raw.recv(4096):
            data += chunk
        assert b"exceeds the limit" in data
        raw.close()
        with c.get(key) as lease:
            assert bytes(lease.buffer) == b"keep" * 1000
        c.check_integrity()


def test_the_removed_single_commit_op_is_an_unknown_op_and_the_connection_goes_on(daemon):
    """"commit" (the single-object commit, gone from the wire: clients commit with
    commit_many) gets the error any unknown op gets, commits nothing, and the connection
    and its write lease go on."""
    from kvstore import messages as m

    def raw(core, op: str, args: dict):
        (reply,) = yield [Request(next(core._ids), op, args)]
        return reply

    with daemon.client() as c:
        key, data = ids(1)[0], bytes([7]) * 100
        c._run(c.core.op_open("default"))
        lease = c._run(c.core.op_simple(m.Reserve("default", key, 100, StateDescriptor("default", "m", "r"))))
        c.core.arenas["default"][lease.offset:lease.offset + 100] = 7
        checksum = xxhash.xxh3_128_digest(data)
        old = c._run(raw(c.core, "commit", {"lease": lease.lease, "checksum": checksum}))
        unknown = c._run(raw(c.core, "no_such_op", {}))
        assert old.error["code"] == unknown.error["code"] == "protocol"
        assert old.error["message"].startswith("unknown op 'commit'; known: ")
        assert old.error["message"] == unknown.error["message"].replace("'no_such_op'", "'commit'")
        assert c.lookup([key]).hits == 0  # nothing was committed
        assert not commit_one(c, lease.lease, checksum).exists  # the lease is still the client's to commit
        with c.get(key) as got:
            assert bytes(got.buffer) == data
        c.check_integrity()


def test_daemon_gone_raises_one_error_then_reconnect_works(daemon):
    c = daemon.client(timeout_s=5)
    c.put(ids(1)[0], b"x")
    daemon.stop(signal.SIGKILL)
    with pytest.raises(DaemonUnavailable):
        c.put(ids(1)[0], b"x")
    with pytest.raises(DaemonUnavailable, match="reconnect"):
        c.lookup(ids(1))
    with pytest.raises(DaemonUnavailable, match="kvstore serve"):
        c.reconnect()
    daemon.start()  # a fresh daemon on the same (stale) socket path
    c.reconnect()
    assert c.lookup(ids(1)).hits == 0
    c.put(ids(1)[0], b"y")
    c.close()


def test_sigterm_shuts_down_cleanly_and_socket_is_private(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    with daemon.client() as c:
        c.put(ids(1)[0], b"x")
    assert daemon.stop(signal.SIGTERM) == 0
    assert not os.path.exists(daemon.socket)


def test_second_daemon_on_the_same_socket_refuses_to_start(daemon):
    proc = subprocess.run([sys.executable, "-m", "kvstore.commands.cli", "serve", "--socket", daemon.socket, "--arena-bytes", "1MiB"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"(pid {daemon.proc.pid}) is starting or serving at {daemon.socket}" in proc.stderr
    with daemon.client() as c:
        c.stats()


def test_async_client_matches_sync(daemon):
    import asyncio
    from kvstore.client import AsyncClient

    async def main():
        c = await AsyncClient.connect(daemon.socket)
        keys = ids(20)
        results = await c.put_many([(k, payload(10_000, i)) for i, k in enumerate(keys)])
        assert all(r.error is None for r in results)
        assert (await c.lookup(keys)).hits == 20
        out = np.empty(10_000, np.uint8)
        assert await c.get_into(keys[3], out) == 10_000 and np.array_equal(out, payload(10_000, 3))
        lease = await c.get(keys[4])
        assert lease.verify()
        lease.release()
        got = await asyncio.gather(*[c.get_into(k, np.empty(10_000, np.uint8)) for k in keys])
        assert got == [10_000] * 20
        assert await c.delete(keys) == 20
        await c.check_integrity()
        await c.close()

    asyncio.run(main())
