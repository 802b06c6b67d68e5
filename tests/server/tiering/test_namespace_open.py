"""Reads create nothing: only a put makes a namespace's arena (a get or lookup in an unknown
namespace used to make and prefault a whole arena for it)."""

import asyncio
import signal

import numpy as np
import pytest

from kvstore.config import HostTierConfig
from kvstore.errors import InvalidArgument, ServiceError
from kvstore.identity import ObjectId
from kvstore.server.tiering.chain import compose

MiB = 1 << 20


def ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return [ObjectId(rng.bytes(32)) for _ in range(n)]


def arenas(client) -> set[str]:
    return set(client.stats()["namespaces"])


def test_reads_in_an_unknown_namespace_make_no_arena(daemon):
    keys = ids(3)
    with daemon.client(namespace="ghost") as c:
        before = arenas(c)
        assert "ghost" not in before
        assert c.get(keys[0]) is None
        assert c.get_into(keys[0], np.empty(10, np.uint8)) is None
        assert c.lookup(keys).hits == 0
        assert c.delete(keys) == 0 and c.pin(keys) == 0 and c.unpin(keys) == 0
        assert arenas(c) == before
        c.put(keys[0], b"now it exists")  # a put makes (and maps) the arena
        assert "ghost" in arenas(c)
        with c.get(keys[0]) as lease:
            assert bytes(lease.buffer) == b"now it exists"


def test_a_reader_sees_a_namespace_another_client_made_after_it_looked(daemon):
    key = ids(1, seed=1)[0]
    with daemon.client(namespace="late") as reader, daemon.client(namespace="late") as writer:
        assert reader.get(key) is None  # opened to read: no arena there yet
        writer.put(key, b"written later")
        with reader.get(key) as lease:  # the reader maps the arena now
            assert bytes(lease.buffer) == b"written later"
        assert reader.lookup([key]).hits == 1


def test_a_get_of_an_nvme_object_makes_the_arena_it_lands_in(daemon_factory):
    d = daemon_factory("16MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB"}})
    keys = ids(2, seed=2)
    data = np.random.default_rng(3).integers(0, 256, MiB, dtype=np.uint8)
    with d.client(namespace="cold") as c:
        c.put(keys[0], data)
    assert d.stop(signal.SIGTERM) == 0  # flushed to NVMe; after the restart "cold" has no arena
    d.start("16MiB")
    with d.client(namespace="cold") as c:
        assert "cold" not in arenas(c)
        assert c.lookup(keys).tiers == ("nvme", None)
        assert c.get(keys[1]) is None and "cold" not in arenas(c)  # a miss still makes nothing
        out = np.empty(MiB, np.uint8)
        assert c.get_into(keys[0], out) == MiB and np.array_equal(out, data)
        assert "cold" in arenas(c)


def test_a_namespace_of_multibyte_characters_longer_than_a_memfd_name_stores_and_reads(daemon):
    """Issue 41 item 13: 100 CJK characters (300 bytes of UTF-8) answered "internal error:
    OSError [Errno 22]": the shared index's memfd name was cut by characters, and Linux
    limits it in bytes. The longest name the rules allow, in 4-byte characters, too."""
    for namespace in ("界" * 100, "𝄞" * 256):
        key = ids(1, seed=4)[0]
        with daemon.client(namespace=namespace) as c:
            c.put(key, b"state of a tenant with a long name")
            assert namespace in arenas(c)
            with c.get(key) as lease:
                assert bytes(lease.buffer) == b"state of a tenant with a long name"


def test_a_namespace_with_a_control_character_is_refused_on_the_wire_and_never_made(daemon):
    """Issue 41 item 15: a namespace holding a newline was made, then forged lines of the
    daemon's log (a fake level=error) and showed in `kvstore status`. The client refuses it
    in a descriptor; a client that sends it anyway is refused by the daemon."""
    forged = "x\nts=2026-01-01T00:00:00Z level=error event=forged"
    key = ids(1, seed=5)[0]
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match=r"open\.namespace: namespace must be .* control character"):
            c._run(c.core.op_open(forged))  # the open a writer sends first
        with pytest.raises(InvalidArgument, match=r"namespace must be .* control character"):
            c.lookup([key], namespace="tenant\u2028b")
        assert not any(any(ch in name for ch in "\n\u2028") for name in arenas(c))


def test_a_client_with_a_bad_default_namespace_is_refused_at_connect(daemon):
    """Not at its first call: Client.connect(namespace=...) names the rule at once."""
    from kvstore.client import AsyncClient, Client
    import asyncio
    with pytest.raises(InvalidArgument, match="namespace must be .* control character"):
        Client.connect(daemon.socket, namespace="a\nb")

    async def connect():
        await AsyncClient.connect(daemon.socket, namespace="a\tb")
    with pytest.raises(InvalidArgument, match="namespace must be"):
        asyncio.run(connect())


def test_a_namespace_opened_while_the_daemon_stops_is_refused_with_a_service_error():
    """A request still served during a stop (SIGTERM) opened a new arena in the executor that
    was shutting down: RuntimeError ("Executor shutdown has been called") as an internal
    error in the log. It says the daemon is stopping."""
    async def run():
        tiers = compose(HostTierConfig(arena_bytes=4 * MiB, prefault=False))
        await tiers.host.open_namespace("before")
        tiers.host.stopping.set()
        with pytest.raises(ServiceError, match="stopping"):
            await tiers.host.open_namespace("during")
        assert (await tiers.host.open_namespace("before")).name == "before"  # open ones still serve
    asyncio.run(run())
