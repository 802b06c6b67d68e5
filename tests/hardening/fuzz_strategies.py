"""Hypothesis strategies shared by the codec and live-socket fuzz tests (holds no tests)."""

from __future__ import annotations

import msgpack
from hypothesis import strategies as st

from kvstore import messages as m
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.protocol import HEADER, MAX_BATCH, Request

wire_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.binary(max_size=40),
)
wire_values = st.recursive(
    wire_leaves, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=25,
)
HOSTILE = [
    None, True, 0, -1, -(2**63), 2**63, 2**64 - 1, 1.5, float("nan"), float("inf"), -0.0, "", "x" * 1025, "\x00",
    "²", "٣/5", "../../etc/passwd", b"", b"\x00" * 31, b"\x00" * 33, b"\xff" * 32, [], [None], {}, {"a": 1},
    [b"\x00" * 32] * (MAX_BATCH + 1), "int3", "fp8", "paged(layers=-1)", "raw(bytes=²)", "0/0", "-1/2",
    "paged(order=layer_first,layers=99999999999999999999,block=16,kv_heads=8,head_dim=128)",
    {"namespace": "t", "model": "m", "model_revision": "r", "dtype": "int3"},
    {"namespace": "t", "model": "m", "model_revision": "r", "layout": "paged(block=0)"},
    {"namespace": "t", "model": "m", "model_revision": "r", "shard": "3/2"}, {"ttl_s": -1}, {"priority": 11},
    # str.isdigit() accepts these, int() does not: both once escaped as ValueError ("internal")
    {"namespace": "t", "model": "m", "model_revision": "r", "shard": "²/3"},
    {"namespace": "t", "model": "m", "model_revision": "r", "layout": "raw(bytes=²)"},
    [[0, 0]], [[-1, 1]], [[0]], [[0, 2**40]], [[0, 1]] * (MAX_BATCH + 1),  # byte ranges
    "t\nts=1 level=error", {"namespace": "t\x1b[2J", "model": "m", "model_revision": "r"},  # forge log lines
    {"ttl_s": 2**64 - 1}, 1e300,  # past a century: a TTL msgpack carries, refused by name
]
hostile = st.sampled_from(HOSTILE) | wire_values

# Names by kvstore.identity.NAME_RULE: any script, no control characters or line separators
# (categories Cc, Zl, Zp; utf-8 leaves out surrogates). A name with one is among HOSTILE.
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Zl", "Zp")), min_size=1, max_size=24)
oids = st.binary(min_size=32, max_size=32).map(ObjectId)
id_batches = st.lists(oids, max_size=8).map(tuple)
LAYOUTS = ["raw(bytes=0)", "paged(order=layer_first,layers=2,block=16,kv_heads=1,head_dim=8)",
           "recurrent(layers=2,heads=4,k_dim=32,v_dim=32)",
           "mla(order=block_first,layers=4,block=16,latent_dim=512,rope_dim=64)"]
descriptors = st.builds(
    StateDescriptor, names, names, names, st.sampled_from(["kv", "mla_latent", "recurrent", "conv", "indexer"]),
    st.sampled_from(["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "mxfp8"]), st.sampled_from(LAYOUTS),
    st.sampled_from(["0/1", "1/4"]), st.sampled_from([16, 256]),
)
hints = st.builds(Hints, st.none() | st.floats(0, 1e6), st.integers(-10, 10), st.none() | st.text(max_size=8),
                  st.none(), st.none() | st.floats(0, 10), st.none() | st.floats(0, 1e3), st.booleans())
leases = st.integers(1, 2**63 - 1)
byte_ranges = st.none() | st.lists(st.tuples(st.integers(0, 2**39), st.integers(1, 2**20)), min_size=1,
                                   max_size=8).map(tuple)
no_neg = st.none() | st.floats(0, 1e6)
expected = st.lists(descriptors, min_size=1, max_size=3).map(tuple)


def _lookup_expecting(namespace, ids, expect) -> m.Lookup:
    """One descriptor for every id, or per id one of them (every third id: none)."""
    if len(expect) == 1:
        return m.Lookup(namespace, ids, expect)
    of = bytes(m.NO_EXPECTATION if i % 3 == 2 else i % len(expect) for i in range(len(ids)))
    return m.Lookup(namespace, ids, expect, of)


def _commit_group(manifest, ids, lease, exists) -> m.CommitGroup:
    """A group commit over `ids`: every member leased (`lease`, `lease`+1, ...) or, with
    `exists`, every other one said to be stored already."""
    leases = [0 if exists and i % 2 else lease + i for i in range(len(ids))]
    return m.CommitGroup(manifest, b"".join(ids), m.pack_uints(leases), bytes(16 * len(ids)))


def _lookup_groups(namespace, ids, split, expect) -> m.LookupGroups:
    counts = [len(ids)] if not split else [1] * len(ids)
    return m.LookupGroups(namespace, b"".join(ids), m.pack_uints(counts), expect)


group_ids = st.lists(oids, min_size=1, max_size=8, unique=True)
messages = st.one_of(
    st.builds(m.Hello, st.text(max_size=20), st.integers(0, 2**31)),
    st.builds(m.OpenNamespace, names, st.none() | st.text(max_size=40), st.booleans(), st.booleans()),
    st.builds(lambda d, o, s, h: m.Reserve(d.namespace, o, s, d, h), descriptors, oids, st.integers(1, 2**40), hints),
    st.builds(lambda lease, c: m.CommitMany.of([lease], [c]), leases, st.binary(min_size=16, max_size=16)),
    st.builds(m.Abort, leases),
    st.builds(m.Get, names, oids, st.none(), byte_ranges, st.none() | descriptors), st.builds(m.Release, leases),
    st.builds(m.Lookup, names, id_batches), st.builds(_lookup_expecting, names, id_batches, expected),
    st.builds(m.Delete, names, id_batches, st.sampled_from(m.SCOPES)),
    st.builds(m.Pin, names, id_batches, st.none() | st.floats(1e-3, 1e6), st.sampled_from(m.SCOPES)),
    st.builds(m.Unpin, names, id_batches, st.sampled_from(m.SCOPES)),
    st.builds(m.Prefetch, names, id_batches, st.sampled_from(m.TIERS), st.sampled_from(m.PREFETCH_POLICIES), no_neg),
    st.just(m.Stats()), st.just(m.Check()),
    st.builds(lambda d, o, h: m.ReserveMany.of(d.namespace, o, [1 + i for i in range(len(o))], d, h),
              descriptors, st.lists(oids, min_size=1, max_size=8), hints),
    st.builds(lambda ls: m.CommitMany.of(ls, [bytes(16)] * len(ls)), st.lists(leases, min_size=1, max_size=8)),
    st.builds(m.GetMany.of, names, st.lists(oids, min_size=1, max_size=8), st.none() | descriptors),
    st.builds(m.ReleaseMany.of, st.lists(leases, min_size=1, max_size=8)),
    st.builds(m.Touch, names, id_batches),
    st.builds(_commit_group, st.integers(0, 2**40), group_ids, st.integers(1, 2**40), st.booleans()),
    st.builds(_lookup_groups, names, group_ids, st.booleans(), st.none() | st.tuples(descriptors)),
    st.builds(lambda n, ids, e: m.GetGroup(n, b"".join(ids), e), names, group_ids, st.none() | st.tuples(descriptors)),
)


requests = st.builds(lambda i, msg, nr: Request(i, msg.op, msg.to_args(), nr),
                     st.integers(0, 2**64 - 1), messages, st.booleans())


def body_frame(value) -> bytes:
    """A frame around any msgpack value: the length header is right, the body may be anything."""
    data = msgpack.packb(value, use_bin_type=True)
    return HEADER.pack(len(data)) + data
