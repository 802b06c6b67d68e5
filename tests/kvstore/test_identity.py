import hashlib
import json
import pathlib
import struct
import subprocess
import sys
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore import ObjectId, Shard, StateDescriptor, chunk_keys, namespace_salt
from kvstore.errors import InvalidArgument
from kvstore.identity import check_name

VECTORS = pathlib.Path(__file__).resolve().parents[2] / "kvstore" / "vectors" / "key-v1.json"


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def reference_ids(case: dict) -> tuple[list[str], list[str]]:
    """The scheme as written in kvstore/identity.py's docstring, straight from hashlib."""
    secret = bytes.fromhex(case["secret"]) if case["secret"] else b""
    salt = hashlib.blake2b(case["namespace"].encode(), digest_size=32, key=secret, person=b"kvstore-ns-v1").digest()
    h = hashlib.blake2b(_field(b"kvstore-key-v1") + _field(case["model"].encode()) + _field(case["model_revision"].encode()),
                        digest_size=32, key=salt).digest()
    chain, ids = [], []
    c = case["chunk_tokens"]
    extras = [e.encode() for e in case["extra_keys"]]
    for i in range(len(case["tokens"]) // c):
        toks = b"".join(struct.pack("<I", t) for t in case["tokens"][i * c:(i + 1) * c])
        h = hashlib.blake2b(h + _field(toks) + struct.pack("<I", len(extras)) + b"".join(map(_field, extras)),
                            digest_size=32, key=salt).digest()
        oid = hashlib.blake2b(h + _field(case["kind"].encode()) + _field(case["shard"].encode())
                              + _field(case["dtype"].encode()) + _field(case["layout"].encode()),
                              digest_size=32, key=salt, person=b"kvstore-obj-v1").digest()
        chain.append(h.hex())
        ids.append(oid.hex())
    return chain, ids


def _desc(case):
    return StateDescriptor(case["namespace"], case["model"], case["model_revision"], case["kind"],
                           case["dtype"], case["layout"], case["shard"], case["chunk_tokens"])


CASES = json.loads(VECTORS.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_published_vectors_match_code_and_spec(case):
    secret = bytes.fromhex(case["secret"]) if case["secret"] else None
    keys = chunk_keys(case["tokens"], _desc(case), extra_keys=case["extra_keys"], secret=secret)
    assert [k.object_id.hex for k in keys] == case["expected"]["object_ids"]
    assert [k.logical.hex() for k in keys] == case["expected"]["chain"]
    assert reference_ids(case) == (case["expected"]["chain"], case["expected"]["object_ids"])
    assert namespace_salt(case["namespace"], secret).hex() == case["expected"]["salt"]


def test_ids_agree_across_processes_with_different_hash_seeds():
    # Users of other stores lose every hit when PYTHONHASHSEED differs per process.
    code = ("from kvstore import StateDescriptor, chunk_keys;"
            "print(chunk_keys(list(range(512)), StateDescriptor('t','m','r'))[-1].object_id.hex)")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(VECTORS.parents[2])}).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1 and len(outs.pop().strip()) == 64


def test_every_identity_field_changes_the_id():
    base = StateDescriptor("t", "m", "r", "kv", "bf16", "paged(order=layer_first,layers=2,block=16,kv_heads=2,head_dim=8)")
    tokens = list(range(256))
    variants = [
        base, base.with_(namespace="u"), base.with_(model="m2"), base.with_(model_revision="r2"),
        base.with_(kind="indexer"), base.with_(dtype="fp8_e4m3"), base.with_(shard=Shard(1, 2)),
        base.with_(layout="paged(order=block_first,layers=2,block=16,kv_heads=2,head_dim=8)"),
    ]
    ids = {chunk_keys(tokens, d)[0].object_id for d in variants}
    ids.add(chunk_keys(tokens, base, extra_keys=["lora-1"])[0].object_id)
    ids.add(chunk_keys(tokens[:255] + [999], base)[0].object_id)
    assert len(ids) == len(variants) + 2


def test_chain_depends_on_whole_prefix_and_partial_chunk_has_no_key():
    d = StateDescriptor("t", "m", "r", chunk_tokens=4)
    a = chunk_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], d)
    b = chunk_keys([0, 2, 3, 4, 5, 6, 7, 8], d)
    assert len(a) == 2 and a[1].end_token == 8
    assert a[1].object_id != b[1].object_id  # same second chunk, different first chunk
    assert chunk_keys([1, 2, 3], d) == []


def test_chunk_extra_keys_apply_to_one_chunk_only():
    d = StateDescriptor("t", "m", "r", chunk_tokens=2)
    plain = chunk_keys([1, 2, 3, 4], d)
    image = chunk_keys([1, 2, 3, 4], d, chunk_extra_keys={1: [b"\x01" * 32]})
    assert plain[0] == image[0] and plain[1] != image[1]


def test_namespaces_never_share_ids():
    tokens = list(range(256))
    a = chunk_keys(tokens, StateDescriptor("tenant-a", "m", "r"))
    b = chunk_keys(tokens, StateDescriptor("tenant-b", "m", "r"))
    assert a[0].object_id != b[0].object_id and a[0].logical != b[0].logical


@pytest.mark.parametrize("bad", [[-1], [2**32], ["7"], [1.5]])
def test_bad_token_ids_rejected(bad):
    with pytest.raises(InvalidArgument, match="token ids"):
        chunk_keys(bad * 256, StateDescriptor("t", "m", "r"))


def test_numpy_tokens_accepted():
    np = pytest.importorskip("numpy")
    d = StateDescriptor("t", "m", "r", chunk_tokens=8)
    assert chunk_keys(np.arange(16, dtype=np.int64), d) == chunk_keys(list(range(16)), d)


@pytest.mark.parametrize("kwargs, match", [
    ({"namespace": ""}, "namespace"),
    ({"model": "x" * 300}, "model"),
    ({"kind": "kvv"}, "unknown kind"),
    ({"dtype": "int4"}, "unknown dtype"),
    ({"layout": "paged(layers=2)"}, "missing"),
    ({"shard": "3/2"}, "shard"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
])
def test_descriptor_validation_names_the_field(kwargs, match):
    args = {"namespace": "t", "model": "m", "model_revision": "r", **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        StateDescriptor(**args)


@pytest.mark.parametrize("field", ["namespace", "model", "model_revision"])
@pytest.mark.parametrize("name", ["a\nts=1 level=error event=forged", "a\rb", "tab\there", "\x1b[31mred", "a\x00b",
                                  "a\x7fb", "a\x85b", "a\u2028b", "a\u2029b", "a\ud800b"])
def test_a_name_with_a_control_character_is_refused_saying_the_rule(field, name):
    """Issue 41 item 15: a namespace holding a newline forged lines of the daemon's log."""
    args = {"namespace": "t", "model": "m", "model_revision": "r", field: name}
    with pytest.raises(InvalidArgument, match=rf"{field} must be 1\.\.256 characters, none of them a control character"):
        StateDescriptor(**args)
    if field == "namespace":
        with pytest.raises(InvalidArgument, match="control character"):
            namespace_salt(name)


@given(st.text(min_size=1, max_size=40))
def test_a_name_is_refused_exactly_when_it_holds_a_control_character_separator_or_surrogate(name):
    refused = any(unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cs") for ch in name)
    if refused:
        with pytest.raises(InvalidArgument, match="control character"):
            check_name("namespace", name)
    else:
        assert check_name("namespace", name) == name


@pytest.mark.parametrize("name", ["tenant-a", "界" * 256, "𝄞 with spaces", "a.b/c:d=e", "\u00a0nbsp", "zwj\u200d"])
def test_printable_names_in_any_script_are_names(name):
    assert StateDescriptor(name, name, name).namespace == name and len(namespace_salt(name)) == 32


def test_descriptor_wire_round_trip_and_unknown_fields():
    d = StateDescriptor("t", "m", "r", "mla_latent", "mxfp8", "mla(order=layer_first,layers=2,block=64,latent_dim=512,rope_dim=64)", "1/4", 64)
    assert StateDescriptor.from_wire(d.to_wire()) == d
    with pytest.raises(InvalidArgument, match="unknown descriptor field"):
        StateDescriptor.from_wire({**d.to_wire(), "rank": 3})


def test_object_id_hex():
    oid = ObjectId(bytes(range(32)))
    assert ObjectId.from_hex(oid.hex) == oid and len(str(oid)) == 64
    for bad in ("zz" * 32, "00" * 31, 5):
        with pytest.raises(InvalidArgument):
            ObjectId.from_hex(bad)


def test_an_object_id_is_its_digest_and_keys_a_dict_as_one():
    import pickle

    from kvstore.errors import InvalidArgument
    from kvstore.identity import ObjectId
    raw = bytes(range(32))
    oid = ObjectId(raw)
    assert oid == raw and hash(oid) == hash(raw) and {raw: 1}[oid] == 1 and {oid: 2}[raw] == 2
    assert type(oid.digest) is bytes and oid.digest == raw
    assert oid.hex == raw.hex() and str(oid) == raw.hex() and ObjectId.from_hex(raw.hex()) == oid
    assert ObjectId(oid) is oid
    back = pickle.loads(pickle.dumps(oid))
    assert type(back) is ObjectId and back == oid
    for bad in (raw[:31], raw + b"\0", raw.hex(), bytearray(raw)):
        with pytest.raises(InvalidArgument, match="32 bytes"):
            ObjectId(bad)


def test_a_descriptor_hashes_once_and_stays_a_good_key_in_another_process():
    """The hash is kept from construction (hot paths hash a descriptor per object); a pickled
    descriptor is rebuilt from its fields, so another process (another str hash seed) finds
    it as a key like one it made itself."""
    import os
    import pickle
    import subprocess
    import sys
    d = StateDescriptor("t", "m", "r", kind="recurrent", dtype="fp32", layout="raw(bytes=64)")
    assert hash(d) == hash(StateDescriptor("t", "m", "r", kind="recurrent", dtype="fp32", layout="raw(bytes=64)"))
    assert hash(d.with_(dtype="bf16")) != hash(d) and d.with_(dtype="bf16") != d
    code = ("import pickle, sys; from kvstore.identity import StateDescriptor as S; d = pickle.loads(sys.stdin.buffer.read()); "
            "print({S('t', 'm', 'r', kind='recurrent', dtype='fp32', layout='raw(bytes=64)'): 'found'}.get(d, 'missing'))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(d), capture_output=True, env=env, check=True)
    assert out.stdout.decode().strip() == "found"
