"""NvmeDeadlines: what is due comes out once, discarded keys never, and the heap stays bounded."""

import pytest

from kvstore.server.tiering.nvme_deadlines import NvmeDeadlines


def test_due_keys_come_out_once_in_deadline_order_and_discarded_ones_never():
    d = NvmeDeadlines()
    d.add(b"a", 10.0)
    d.add(b"b", 5.0)
    d.add(b"c", 20.0)
    d.discard(b"c")
    assert d.expired(b"b", 5.0) and not d.expired(b"a", 9.9) and not d.expired(b"c", 99.0)
    assert d.due(12.0) == [b"b", b"a"]
    assert d.due(99.0) == [] and len(d) == 0


def test_a_deadline_added_again_replaces_the_old_one():
    d = NvmeDeadlines()
    d.add(b"a", 1.0)
    d.add(b"a", 50.0)  # an object put again (or retried later) keeps only its newest deadline
    assert d.due(10.0) == [] and d.due(60.0) == [b"a"]


def test_many_discarded_items_are_dropped_from_the_heap():
    d = NvmeDeadlines()
    for i in range(10_000):
        d.add(i.to_bytes(4, "little"), 100.0 + i)
    for i in range(9_900):
        d.discard(i.to_bytes(4, "little"))
    d.due(0.0)
    assert len(d._heap) == 100 and len(d) == 100


def test_check_integrity_names_a_deadline_of_an_object_not_held():
    d = NvmeDeadlines()
    d.add(b"gone", 5.0)
    with pytest.raises(RuntimeError, match="does not hold"):
        d.check_integrity(lambda key: False)
    d.check_integrity(lambda key: True)
