"""Hints are checked when they are made (kvstore/hints.py), with the duration rule of
kvstore/units.py that the wire and the admin API share."""

import math

import msgpack
import pytest

from kvstore.errors import InvalidArgument
from kvstore.hints import Hints
from kvstore.units import MAX_DURATION_S


@pytest.mark.parametrize("field, value", [
    ("ttl_s", 2**64), pytest.param("ttl_s", 10**400, id="ttl_s-10**400"), ("ttl_s", MAX_DURATION_S + 1),
    ("ttl_s", -1), ("ttl_s", math.inf), ("ttl_s", math.nan), ("ttl_s", True), ("ttl_s", "60"),
    ("next_access_s", 2**64), ("recompute_cost_ms", 1e300),
])
def test_hints_with_a_duration_out_of_range_are_refused_naming_the_field_and_the_range(field, value):
    """Issue 41 item 8: Hints(ttl_s=2**64) was accepted, and the put that carried it failed
    later, in msgpack, with a bare OverflowError."""
    with pytest.raises(InvalidArgument, match=rf"hint {field} must be a number of \w+ in 0\.\.[0-9,]+, got"):
        Hints(**{field: value})


def test_every_duration_in_range_is_kept_and_travels_the_wire():
    for hints in (Hints(ttl_s=0), Hints(ttl_s=MAX_DURATION_S), Hints(ttl_s=0.5, next_access_s=MAX_DURATION_S,
                                                                      recompute_cost_ms=MAX_DURATION_S * 1000)):
        assert Hints.from_wire(msgpack.unpackb(msgpack.packb(hints.to_wire()))) == hints


def test_hints_from_a_hostile_peer_are_refused_like_those_made_here():
    with pytest.raises(InvalidArgument, match="hint ttl_s must be a number of seconds"):
        Hints.from_wire({"ttl_s": 2**64 - 1})  # the largest integer msgpack carries


def test_of_takes_hints_or_none_and_refuses_anything_else():
    assert Hints.of(None) == Hints() and Hints.of(Hints(ttl_s=5)) == Hints(ttl_s=5)
    with pytest.raises(InvalidArgument, match="hints must be a kvstore.hints.Hints or None, got dict"):
        Hints.of({"ttl_s": 5})


def test_hints_stored_before_the_range_existed_read_as_its_limit_not_an_error():
    """An NVMe record written before TTLs were capped (ttl_s = 1e12 was accepted) must stay
    readable after an upgrade: its duration reads as the limit, a century."""
    stored = {"ttl_s": 1e12, "next_access_s": 2 ** 70, "recompute_cost_ms": 1e300, "priority": 3}
    hints = Hints.from_record(stored)
    assert (hints.ttl_s, hints.next_access_s) == (MAX_DURATION_S, MAX_DURATION_S)
    assert hints.recompute_cost_ms == MAX_DURATION_S * 1000 and hints.priority == 3
    with pytest.raises(InvalidArgument, match="ttl_s"):
        Hints.from_wire(stored)  # from a client or a peer: refused as before
    with pytest.raises(InvalidArgument, match="unknown hint"):
        Hints.from_record({"bogus": 1})
