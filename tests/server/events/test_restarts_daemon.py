"""A daemon restarted under a router that stays connected, as vLLM's subscriber rules read it
(kvs_events.VllmRules: replay when a number skips, apply every frame; nothing of kvstore's).

A restart must read as a gap to such a router, and the replay it then asks for must begin the
new life with AllBlocksCleared: the router ends with the new daemon's blocks, none of the old.
"""

import os
import signal

import pytest

from kvstore.identity import ObjectId
from kvs_events import EventSubscriber, VllmRules, last_seq
from kvstore.server.events.lives import SEQ_PER_LIFE

# Bytes hashes: events name objects by their ids. Heartbeats often, so a router connected
# after the new daemon's batches went learns the latest number soon (vLLM's rule then replays).
EVENTS = {"events": {"enabled": True, "int_block_hashes": False, "heartbeat_s": 0.2}}


def new_ids(n):
    return [ObjectId(os.urandom(32)) for _ in range(n)]


def put_all(d, keys) -> int:
    """Put `keys` into `default`; the number of the batch that holds the last of them."""
    with d.client() as c:
        for key in keys:
            c.put(key, b"x" * 100)
        return last_seq(c, "default")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_router_following_vllms_rules_ends_with_the_new_daemons_blocks_after_a_restart(daemon_factory, sig):
    d = daemon_factory("16MiB", config=EVENTS)
    router = VllmRules(EventSubscriber(d, "default"))
    try:
        old = new_ids(5)
        with d.client() as c:  # the subscription takes a moment: put until a frame arrives
            while not router.step(timeout_ms=100):
                c.put(new_ids(1)[0], b"probe")
        router.follow_until(put_all(d, old), "the old daemon's puts")
        assert {bytes(k) for k in old} <= router.held["CPU"]
        old_last = router.last
        assert d.stop(sig) is not None
        d.start("16MiB")
        new = new_ids(3)
        new_last = put_all(d, new)  # at once: the router's SUB may reconnect after these went
        router.follow_until(new_last, "the new daemon's puts")
    finally:
        router.subscriber.close()
    assert {m: h for m, h in router.held.items() if h} == {"CPU": {bytes(k) for k in new}}
    assert new_last // SEQ_PER_LIFE == 1 and new_last > old_last + 1  # a gap to vLLM's rule, always


def test_a_namespace_idle_since_a_sigkill_is_cleared_for_a_router_that_stayed(daemon_factory):
    """Nothing is put after the restart: the new daemon still tells the router to drop what
    the killed one held (every namespace an earlier life published gets AllBlocksCleared)."""
    d = daemon_factory("16MiB", config=EVENTS)
    router = VllmRules(EventSubscriber(d, "default"))
    try:
        with d.client() as c:
            while not router.step(timeout_ms=100):
                c.put(new_ids(1)[0], b"probe")
        router.follow_until(put_all(d, new_ids(4)), "the puts")
        assert router.held["CPU"]
        assert d.stop(signal.SIGKILL) is not None
        d.start("16MiB")
        with d.client() as c:
            assert "default" in c.stats()["events"]["namespaces"], "the new daemon sent no AllBlocksCleared"
            router.follow_until(last_seq(c, "default"), "the new daemon's first batch")
            life = c.stats()["events"]["life"]
    finally:
        router.subscriber.close()
    assert not any(router.held.values()), router.held
    assert life == 1
