"""Byte ranges (kvstore.ranges): the wire codec, packing, and ReadLease.read over packed ranges."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.client.lease import ReadLease
from kvstore import messages as m
from kvstore import ranges
from kvstore.errors import DaemonUnavailable, InvalidArgument, LeaseEnded, RangeError
from kvstore.identity import ObjectId

OID = ObjectId(b"r" * 32)


@pytest.mark.parametrize("wire, why", [
    ([], "1..4096"),
    ([[0, 1]] * (ranges.MAX_RANGES + 1), "1..4096"),
    ("0-10", "1..4096"),
    ([[0, 0]], "length >= 1"),
    ([[-1, 4]], "offset >= 0"),
    ([[0, 4, 5]], "got [0, 4, 5]"),
    ([[0, True]], "got [0, True]"),
    ([[0.5, 4]], "got [0.5, 4]"),
    ([[1 << 40, 1]], "within"),
])
def test_bad_ranges_are_refused_with_the_field_named(wire, why):
    args = {"namespace": "default", "object_id": OID.digest, "ranges": wire}
    with pytest.raises(InvalidArgument) as err:
        m.Get.from_args(args)
    assert err.value.message.startswith("get.ranges:") and why in err.value.message


def test_get_without_ranges_decodes_as_before():
    assert m.Get.from_args({"namespace": "default", "object_id": OID.digest}).ranges is None
    msg = m.Get("default", OID, None, ((8, 4), (0, 2)))
    assert m.Get.from_args(msg.to_args()) == msg


def test_check_within_names_the_range_past_the_end():
    ranges.check_within(((0, 10), (90, 10)), 100)
    with pytest.raises(InvalidArgument, match=r"\[95, 105\) reaches past the object's 100 bytes"):
        ranges.check_within(((0, 10), (95, 10)), 100)


@given(st.lists(st.tuples(st.integers(0, 999), st.integers(1, 200)), min_size=1, max_size=20))
def test_pack_then_read_gives_every_range_back(pairs):
    obj = np.random.default_rng(len(pairs)).integers(0, 256, 1200, dtype=np.uint8)
    packed = ranges.pack(obj, pairs)
    assert packed.size == ranges.total(pairs)
    lease = ReadLease(lambda _: None, 1, OID, packed.size, b"", {}, "remote", packed, tuple(pairs))
    for offset, length in pairs:  # unsorted and overlapping alike
        assert np.array_equal(lease.read(offset, length), obj[offset:offset + length])
        if length > 2:  # any part of a range too
            assert np.array_equal(lease.read(offset + 1, length - 2), obj[offset + 1:offset + length - 1])


def test_read_outside_the_held_ranges_is_refused():
    obj = np.arange(100, dtype=np.uint8)
    pairs = ((10, 10), (50, 20))
    lease = ReadLease(lambda _: None, 1, OID, 30, b"", {}, "remote", ranges.pack(obj, pairs), pairs)
    for offset, length in ((0, 5), (15, 10), (45, 10), (60, 11), (-1, 2)):
        with pytest.raises(InvalidArgument, match="not in this lease's ranges"):
            lease.read(offset, length)
    assert not lease.read(50, 20).flags.writeable
    whole = ReadLease(lambda _: None, 2, OID, 100, b"", {}, "host", obj, None)
    assert np.array_equal(whole.read(95, 5), obj[95:])
    with pytest.raises(InvalidArgument, match="outside the object's 100"):
        whole.read(95, 6)


def test_callers_ranges_are_normalized_never_truncated():
    assert ranges.normalize([(np.int64(4), 2), [0, np.uint16(1)]]) == ((4, 2), (0, 1))
    for bad in ([(0.7, 4.9)], [(0, "4")], [(0, 4, 5)], [3], None):
        with pytest.raises(InvalidArgument):
            ranges.normalize(bad)


def test_ranges_adding_up_past_the_object_are_refused():
    with pytest.raises(RangeError, match="add up to 150 bytes, more than the object's 100"):
        ranges.check_within(((0, 100), (0, 50)), 100)
    assert issubclass(RangeError, InvalidArgument) and RangeError("x").code == "invalid_range"


def test_a_released_or_orphaned_lease_refuses_reads():
    class Core:
        closed = False

    core, obj = Core(), np.arange(10, dtype=np.uint8)
    lease = ReadLease(lambda _: None, 1, OID, 10, b"", {}, "host", obj, None, core)
    assert not lease.closed and lease.read(2, 3).tolist() == [2, 3, 4]
    core.closed = True  # the connection went: the daemon took the lease back
    assert lease.closed
    with pytest.raises(LeaseEnded, match="connection to the daemon closed"):
        lease.read(2, 3)
    released = ReadLease(lambda _: None, 2, OID, 10, b"", {}, "host", obj, None, Core())
    released.release()
    with pytest.raises(LeaseEnded, match="it was released"):
        released.read(0, 1)


def test_a_lease_near_the_daemons_ttl_counts_as_ended():
    import time

    class Core:
        closed, lease_ttl_s = False, 0.05

    lease = ReadLease(lambda _: None, 1, OID, 10, b"", {}, "host", np.zeros(10, np.uint8), None, Core())
    time.sleep(0.05 * 0.8 + 0.01)  # past 80% of the ttl: the daemon may take it back any moment
    assert lease.closed
    with pytest.raises(LeaseEnded, match="lease_ttl_s") as ended:
        lease.read(0, 1)
    assert not isinstance(ended.value, DaemonUnavailable)  # the daemon is fine
