"""server.objects: the one way an entry is made and the one liveness rule (issue 14, item 2)."""

import math

import pytest

from kvstore.errors import Conflict
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from server.objects import ObjectEntry, check_same_object

OID = ObjectId(bytes(32))
DESC = StateDescriptor("ns", "m", "r")


def entry(hints, now=100.0, **kwargs):
    return ObjectEntry.create(OID, "ns", None, 10, b"c" * 16, DESC, hints, now, **kwargs)


def test_a_ttl_counts_from_now_and_ends_liveness_exactly_there():
    e = entry(Hints(ttl_s=5.0))
    assert e.expires_at == 105.0
    assert e.is_live(104.999) and not e.is_live(105.0)


def test_without_a_ttl_an_entry_lives_and_is_unpinned_unless_asked():
    e = entry(Hints())
    assert e.expires_at == math.inf and e.is_live(1e12)
    assert e.pinned_until == 0.0 and not e.is_pinned(0.0)
    assert entry(Hints(), pin=True).is_pinned(1e12)


def test_created_at_is_the_wall_clock_unless_carried_over():
    assert entry(Hints(), created_at=42.0).created_at == 42.0
    assert entry(Hints()).created_at > 1e9  # time.time(), not the monotonic `now`


def test_an_id_is_one_state():
    check_same_object(OID, 10, DESC, 10, DESC)
    with pytest.raises(Conflict, match="10 bytes, not 11"):
        check_same_object(OID, 10, DESC, 11, DESC)
