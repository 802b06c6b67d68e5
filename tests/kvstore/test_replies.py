"""Typed replies keep the wire format the daemon sent as plain maps, byte for byte: what an
older client parses, and what an older daemon sends, still parse on the other side."""

import pytest
from reply_wire import assert_sends_the_same_bytes, through_msgpack

from kvstore import replies as r
from kvstore.errors import ProtocolError

DESC = {"namespace": "t", "model": "m", "model_revision": "r"}
CHECKSUM = b"\x01" * 16

# (the map a daemon of before the typed replies sent, its typed reply): literal maps, copied
# from what tier_manager, objects, index_ops, cluster and local_service used to build.
OLD_WIRE = [
    ({"server": "0.1.0", "protocol": 1, "conn": 3,
      "limits": {"max_frame_bytes": 4 << 20, "max_batch": 4096, "max_leases": 4096,
                 "max_inflight_bytes": 256 << 20, "lease_ttl_s": 300.0}},
     r.HelloReply("0.1.0", 1, 3, r.ClientLimits(4 << 20, 4096, 4096, 256 << 20, 300.0))),
    ({"namespace": "t", "arena_bytes": 1 << 30}, r.OpenReply("t", 1 << 30)),
    ({"namespace": "t", "arena_bytes": 0}, r.OpenReply("t", 0)),
    ({"exists": True}, r.ReserveReply(exists=True)),
    ({"lease": 9, "offset": 8192}, r.ReserveReply(lease=9, offset=8192)),
    ({"exists": True}, r.CommitReply(True)),
    ({"exists": False, "tier": "host", "durability": "memory"}, r.CommitReply(False, "host", "memory")),
    ({"exists": False, "tier": "host", "durability": "sync"}, r.CommitReply(False, "host", "sync")),
    ({"exists": False, "tier": "remote", "durability": "memory", "homes": ["a", "b"]},
     r.CommitReply(False, "remote", "memory", ("a", "b"))),
    ({"exists": False, "tier": "host", "durability": "memory", "homes": []}, r.CommitReply(False, "host", "memory", ())),
    ({"hit": False}, r.GetReply(False)),
    ({"hit": False, "reason": "stored as fp16, not in accept list"}, r.GetReply(False, "stored as fp16, not in accept list")),
    ({"hit": True, "lease": 4, "offset": 4096, "size": 100, "checksum": CHECKSUM, "tier": "host", "descriptor": DESC},
     r.GetReply(True, lease=4, offset=4096, size=100, checksum=CHECKSUM, tier="host", descriptor=DESC)),
    ({"hit": True, "lease": 5, "offset": 0, "size": 30, "checksum": CHECKSUM, "tier": "remote", "descriptor": DESC,
      "ranges": [[0, 10], [50, 20]], "object_size": 4096},
     r.GetReply(True, lease=5, offset=0, size=30, checksum=CHECKSUM, tier="remote", descriptor=DESC,
                ranges=((0, 10), (50, 20)), object_size=4096)),
    ({"hits": 1, "tiers": ["host", None], "hit_bytes": 100, "est_load_s": 2.5e-05},
     r.LookupReply(1, ("host", None), 100, 2.5e-05)),
    ({"deleted": 2}, r.DeleteReply(2)),
    ({"pinned": 0}, r.PinReply(0)),
    ({"unpinned": 1}, r.UnpinReply(1)),
    ({"resident": 1, "requested": 3}, r.PrefetchReply(1, 3)),
    ({"resident": 1, "requested": 3, "started": 2}, r.PrefetchReply(1, 3, 2)),
    ({"version": "0.1.0", "tiers": {"host": {"objects": 1}}}, r.StatsReply({"version": "0.1.0", "tiers": {"host": {"objects": 1}}})),
    ({"ok": True}, r.CheckReply(True)),
]


@pytest.mark.parametrize("wire, typed", OLD_WIRE)
def test_typed_replies_send_the_bytes_the_plain_maps_did(wire, typed):
    assert_sends_the_same_bytes(typed.to_wire(), wire)


@pytest.mark.parametrize("wire, typed", OLD_WIRE)
def test_typed_replies_parse_what_an_older_daemon_sends(wire, typed):
    assert type(typed).from_wire(through_msgpack(wire)) == typed


def test_a_field_a_newer_daemon_adds_is_ignored_and_one_an_older_leaves_out_defaults():
    assert r.GetReply.from_wire({"hit": False, "retry_after_s": 1.0}) == r.GetReply(False)
    assert r.HelloReply.from_wire({"server": "0.0.9", "protocol": 1, "conn": 1}).limits.max_inflight_bytes is None
    assert r.PrefetchReply.from_wire({"resident": 0, "requested": 2}).started is None


@pytest.mark.parametrize("kind, wire, message", [
    (r.GetReply, {"lease": 1}, "lacks 'hit'"),
    (r.LookupReply, {"hits": 0, "tiers": []}, "lacks 'hit_bytes'"),
    (r.CommitReply, [True], "not a map"),
    (r.StatsReply, None, "not a map"),
])
def test_a_malformed_reply_is_a_protocol_error_naming_what_is_wrong(kind, wire, message):
    with pytest.raises(ProtocolError, match=message):
        kind.from_wire(wire)


def test_a_lookups_tiers_read_the_same_as_names_or_codes():
    """To a lookup that asks for codes the daemon sends a byte per id (TIER_NAMES' index),
    to one that does not the names; names() reads either, named() turns codes into names."""
    names = ("host", None, "nvme", "remote", None)
    codes = bytes(r.TIER_NAMES.index(name) for name in names)
    packed = r.LookupReply.from_wire(through_msgpack(r.LookupReply(1, (), 10, 0.5, codes).to_wire()))
    assert packed.codes == codes and packed.names() == names
    assert packed.named() == r.LookupReply(1, names, 10, 0.5) and packed.named().to_wire()["tiers"] == list(names)
    assert "codes" not in packed.named().to_wire()
    one = r.LookupReply(0, (), 0, 0.0, b"\x00")
    assert one.names() == (None,) and r.LookupReply(0, (), 0, 0.0).names() == ()
    with pytest.raises(ProtocolError, match="a byte per id below 4"):
        r.LookupReply.from_wire({"hits": 0, "tiers": [], "hit_bytes": 0, "est_load_s": 0.0, "codes": b"\x04"})
    with pytest.raises(ProtocolError, match="a byte per id"):
        r.LookupReply.from_wire({"hits": 0, "tiers": [], "hit_bytes": 0, "est_load_s": 0.0, "codes": [1]})


def test_counts_read_the_same_way_for_every_batch_op():
    assert [reply.count for reply in (r.DeleteReply(2), r.PinReply(3), r.UnpinReply(4), r.PrefetchReply(5, 6))] == [2, 3, 4, 5]


def test_every_op_has_its_reply_kind():
    from kvstore.messages import OPS
    assert set(r.REPLIES) == set(OPS)


def test_replies_are_frozen_slotted_dataclasses_with_the_written_out_init():
    import dataclasses
    got = r.GetReply(True, lease=1, offset=0, size=4)
    assert got == r.GetReply(True, None, 1, 0, 4) and dataclasses.replace(got, size=8).size == 8
    assert dataclasses.fields(got)[0].name == "hit" and not hasattr(got, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.hit = False
    with pytest.raises(TypeError):
        r.GetReply()  # hit is required
