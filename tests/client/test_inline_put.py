"""put_inline: a small put whose bytes travel in its one request (server/local/inline.py).

It must answer exactly what a two-phase put (reserve_many, copy, commit_many) answers:
the same stored bytes, the same dedup and refusals, the same durability."""

import signal

import numpy as np
import pytest

from kvstore import StateDescriptor
from kvstore import messages as m
from kvstore.client.core import INLINE_PUT_BYTES
from kvstore.errors import Conflict, InvalidArgument, PermissionDenied
from kvstore.fields import INLINE_PUT_MAX_BYTES
from kvstore.identity import ObjectId
from kvstore.protocol import Request
from kvs_testing import payload, read_back, sent_ops

KiB = 1024


def ids(n, seed=0):
    return [ObjectId(bytes([seed, i % 256, i // 256]) * 10 + b"in") for i in range(n)]


def test_a_small_put_is_one_request_and_reads_back_bit_exact(daemon):
    sizes = [1, 4095, 4 * KiB, INLINE_PUT_BYTES, INLINE_PUT_BYTES + 1, 1 << 20]
    keys = ids(len(sizes), 1)
    with daemon.client() as c:
        assert c.core.inline_put_bytes == INLINE_PUT_BYTES  # the daemon offered at least that
        c.put(ids(1, 9)[0], payload(8, 0))  # the namespace is open: only puts are sent below
        before = c.stats()["namespaces"]["default"]["num_puts"]
        for key, size in zip(keys, sizes):
            sent = sent_ops(c)
            result = c.put(key, payload(size, key))
            small = size <= INLINE_PUT_BYTES
            assert sent == (["put_inline"] if small else ["reserve_many", "commit_many"]), size
            assert (result.existed, result.tier, result.durability) == (False, "host", "memory")
        assert c.stats()["namespaces"]["default"]["num_puts"] - before == len(sizes)
        for key, size in zip(keys, sizes):
            assert np.array_equal(read_back(c, key, size), payload(size, key))
            with c.get(key) as got:  # a lease whose checksum the client verifies
                assert np.array_equal(np.frombuffer(got.buffer, np.uint8), payload(size, key))
        c.check_integrity()


def test_an_inline_put_dedups_and_refuses_as_a_two_phase_put_does(daemon):
    desc, other = StateDescriptor("default", "m", "r"), StateDescriptor("default", "m", "r2")
    key = ids(1, 2)[0]
    with daemon.client() as c:
        assert not c.put(key, payload(4 * KiB, 1), desc=desc).existed
        assert c.put(key, payload(4 * KiB, 1), desc=desc).existed  # the same state: nothing copied
        refusals = []
        for inline in (c.core.inline_put_bytes, 0):  # inline, then two-phase
            c.core.inline_put_bytes = inline
            for size, d in ((4 * KiB + 1, desc), (4 * KiB, other)):
                with pytest.raises(Conflict) as caught:
                    c.put(key, payload(size, 1), desc=d)
                refusals.append(str(caught.value))
        assert refusals[:2] == refusals[2:] and "4097" in refusals[0] and "r2" in refusals[1]
        # a layout's size is checked before anything is stored
        layout = StateDescriptor("default", "m", "r", "kv", "bf16",
                                 "paged(order=layer_first,layers=2,block=16,kv_heads=1,head_dim=8)", chunk_tokens=16)
        with pytest.raises(InvalidArgument, match="does not match its layout"):
            c.put(ids(1, 3)[0], payload(100, 2), desc=layout)
        assert np.array_equal(read_back(c, key, 4 * KiB), payload(4 * KiB, 1))
        assert c.stats()["leases"] == 0
        c.check_integrity()


@pytest.mark.parametrize("args, named", [
    ({"data": b""}, "put_inline.data: must be 1.."),
    ({"data": bytes(INLINE_PUT_MAX_BYTES + 1)}, f"1..{INLINE_PUT_MAX_BYTES} bytes"),
    ({"data": "text"}, "put_inline.data"),
    ({"data": b"x", "tier": "nvme"}, "put_inline.tier"),
    ({"data": b"x", "object_id": b"short"}, "put_inline.object_id"),
])
def test_a_malformed_put_inline_is_refused_by_field_and_nothing_changes(daemon, args, named):
    key = ids(1, 4)[0]
    desc = StateDescriptor("default", "opaque", "0")

    def raw(core, fields):
        (reply,) = yield [Request(next(core._ids), "put_inline", fields)]
        return reply

    with daemon.client() as c:
        c.put(key, payload(4 * KiB, 4))
        fields = {"namespace": "default", "object_id": ids(1, 5)[0].digest, "descriptor": desc.to_wire(), **args}
        reply = c._run(raw(c.core, fields))
        assert reply.error["code"] == "invalid_argument" and named in reply.error["message"]
        assert c.lookup(ids(1, 5)).hits == 0  # nothing stored
        assert np.array_equal(read_back(c, key, 4 * KiB), payload(4 * KiB, 4))  # and the connection serves on
        assert c.stats()["leases"] == 0
        c.check_integrity()


def test_an_inline_put_into_a_namespace_not_opened_is_refused(daemon):
    with daemon.client() as c:
        desc = StateDescriptor("other", "opaque", "0")
        with pytest.raises(PermissionDenied, match="not open on this connection"):
            c._run(c.core.op_simple(m.PutInline("other", ids(1, 6)[0], desc, b"x" * 10)))


def test_an_inline_put_under_write_through_answers_sync_and_survives_sigkill(daemon_factory):
    """The commit waits for the durable write (an awaited answer after a ready reserve)."""
    d = daemon_factory("16MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB",
                                                 "write_policy": "write_through"}})
    keys = ids(4, 7)
    with d.client() as c:
        sent = sent_ops(c)
        results = [c.put(key, payload(20_000 + i, key)) for i, key in enumerate(keys)]
        assert set(sent) == {"open", "put_inline"}
    assert [r.durability for r in results] == ["sync"] * 4
    d.stop(signal.SIGKILL)
    d.start("16MiB")
    with d.client() as c:
        for i, key in enumerate(keys):
            assert np.array_equal(read_back(c, key, 20_000 + i), payload(20_000 + i, key))
        c.check_integrity()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_inline_puts_that_must_demote_to_make_room_wait_for_it_and_lose_nothing(daemon_factory, policy):
    """A 4 MiB arena and 12 MiB of inline puts: reserves that evict to NVMe first answer
    after that I/O, then copy and commit (under write_through a commit that waits for its
    durable write after a reserve that waited: the answer is the commit's, awaited)."""
    d = daemon_factory("4MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB",
                                                "admit_min_hits": 0, "write_policy": policy}})
    keys = ids(192, 8)
    with d.client() as c:
        sent = sent_ops(c)
        results = [c.put(key, payload(INLINE_PUT_BYTES, key)) for key in keys]
        assert set(sent) == {"open", "put_inline"}
        assert {r.durability for r in results} == {"sync" if policy == "write_through" else "memory"}
        assert c.stats()["namespaces"]["default"]["num_evictions"] > 0
        for key in keys:
            assert np.array_equal(read_back(c, key, INLINE_PUT_BYTES), payload(INLINE_PUT_BYTES, key))
        c.check_integrity()
