"""Property fuzzing of the sans-I/O codec and of typed-message decoding (hypothesis).

Extends tests/kvstore/test_protocol.py from hand-picked cases to generated ones: random
frame streams cut at random points, garbage bodies between valid frames, huge length
headers, any msgpack value as a body, and valid messages with one field made hostile.
The properties: the codec only ever yields typed events, a bad frame never desynchronises
the stream, and decoding a request raises nothing but a RequestError naming the op.
The long, coverage-guided run of the same targets is fuzz/fuzz_codec.py (atheris).
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_strategies import body_frame, hostile, messages, requests, wire_values
from hardening_support import CHILD_ENV, FUZZ_EXAMPLES, REPO
from kvstore import messages as m
from kvstore.errors import RequestError
from kvstore.protocol import HEADER, MAX_BATCH, MAX_FRAME_BYTES, NEED_DATA, BadFrame, Fatal, FrameCodec, Reply, Request

FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def decode(op: str, args: dict):
    """decode_request, asserting that any failure is a RequestError naming the op."""
    try:
        return m.decode_request(Request(1, op, args))
    except RequestError as exc:
        assert (op if op in m.OPS else repr(op[:64])) in exc.message, exc.message
        return exc


# --- typed messages -----------------------------------------------------------------------

@FUZZ
@given(messages)
def test_every_valid_message_survives_the_wire(msg):
    client, server = FrameCodec(), FrameCodec()
    server.receive_data(client.send_request(Request(7, msg.op, msg.to_args())))
    decoded = m.decode_request(server.next_event())
    assert type(decoded) is type(msg) and decoded.to_args() == msg.to_args()


@FUZZ
@given(messages, st.data())
def test_one_hostile_field_is_refused_by_name_or_accepted_canonically(msg, data):
    args = msg.to_args()
    field = data.draw(st.sampled_from(sorted(args) + ["evil"]), label="field")
    if data.draw(st.booleans(), label="drop") and field in args:
        del args[field]
    else:
        args[field] = data.draw(hostile, label="value")
    result = decode(msg.op, args)
    if isinstance(result, RequestError):
        assert field in result.message or "unknown field" in result.message, result.message
    else:  # accepted: the value was in range, and it reads back the same after re-encoding
        assert decode(msg.op, result.to_args()).to_args() == result.to_args()


@FUZZ
@given(st.sampled_from(sorted(m.OPS)) | st.text(max_size=12), st.dictionaries(st.text(max_size=12), wire_values, max_size=8))
def test_arbitrary_args_of_any_op_only_raise_request_errors(op, args):
    decode(op, args)


digits = st.sampled_from(["0", "16", "-1", "²", "٣", "1e3", " 7", "99999999999999999999", ""]) | st.text(max_size=4)
layout_texts = st.builds(
    lambda name, params: f"{name}({','.join(f'{k}={v}' for k, v in params)})",
    st.sampled_from(["paged", "mla", "indexer", "recurrent", "conv", "raw", "nope"]),
    st.lists(st.tuples(st.sampled_from(["order", "layers", "block", "kv_heads", "head_dim", "latent_dim", "rope_dim",
                                        "heads", "k_dim", "v_dim", "channels", "width", "bytes"]), digits), max_size=6),
)


@FUZZ
@given(layout_texts | st.text(max_size=30), st.builds(lambda a, b: f"{a}/{b}", digits, digits) | st.text(max_size=6),
       st.integers(-3, 2**40) | hostile)
def test_hostile_layouts_and_shards_only_raise_invalid_argument(layout, shard, chunk_tokens):
    desc = {"namespace": "t", "model": "m", "model_revision": "r", "layout": layout, "shard": shard,
            "chunk_tokens": chunk_tokens}
    result = decode("reserve", {"namespace": "t", "object_id": b"\x00" * 32, "size": 4096, "descriptor": desc})
    if not isinstance(result, RequestError):
        assert result.descriptor.object_bytes >= 0


@settings(max_examples=40, deadline=None, database=None)
@given(st.sampled_from([m.Lookup, m.Delete, m.Pin, m.Unpin, m.Prefetch]), st.integers(1, 64))
def test_batches_past_the_limit_are_refused_and_the_limit_itself_is_not(cls, extra):
    ids = [bytes([i % 256]) * 32 for i in range(MAX_BATCH + extra)]
    refused = decode(cls.op, {"namespace": "t", "ids": ids})
    assert isinstance(refused, RequestError) and f"at most {MAX_BATCH}" in refused.message
    assert len(decode(cls.op, {"namespace": "t", "ids": ids[:MAX_BATCH]}).ids) == MAX_BATCH


# --- frame streams --------------------------------------------------------------------------

def drain(codec: FrameCodec) -> list:
    events = []
    while (event := codec.next_event()) is not NEED_DATA:
        events.append(event)
        if isinstance(event, Fatal):
            break
    return events


segments = st.one_of(
    requests.map(lambda r: ("valid", r, FrameCodec().send_request(r))),
    st.binary(max_size=64).map(lambda b: ("garbage", None, HEADER.pack(len(b)) + b)),
    wire_values.map(lambda v: ("value", None, body_frame(v))),
    st.integers(1, 50_000).map(lambda n: ("deep", None, HEADER.pack(n + 1) + b"\x91" * n + b"\xc0")),
)


@FUZZ
@given(st.lists(segments, min_size=1, max_size=12), st.lists(st.integers(0, 4096), max_size=10), st.binary(max_size=7))
def test_garbage_between_frames_never_desynchronises_the_stream(segs, cuts, tail):
    stream = b"".join(raw for _, _, raw in segs)
    # a truncated frame at the end: its length header announces more than ever arrives
    truncated = HEADER.pack(len(tail) + 1) + tail if tail else b""
    stream += truncated
    codec, events, last = FrameCodec(), [], 0
    for cut in sorted(c % (len(stream) + 1) for c in cuts) + [len(stream)]:
        codec.receive_data(stream[last:cut])
        last = cut
        events += drain(codec)
    assert len(events) == len(segs), events
    for (kind, request, _), event in zip(segs, events):
        if kind == "valid":
            assert event == request
        else:
            assert isinstance(event, (BadFrame, Request, Reply)), event
            if kind in ("garbage", "deep") and isinstance(event, BadFrame):
                assert event.error.code == "protocol"
    assert codec.next_event() is NEED_DATA


@FUZZ
@given(st.lists(requests, max_size=4), st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1), st.binary(max_size=64))
def test_a_huge_length_header_is_fatal_after_the_frames_before_it(before, length, after):
    codec = FrameCodec()
    codec.receive_data(b"".join(FrameCodec().send_request(r) for r in before) + HEADER.pack(length) + after)
    events = drain(codec)
    assert events[:-1] == before and isinstance(events[-1], Fatal)
    assert str(length) in events[-1].error.message
    codec.receive_data(FrameCodec().send_request(Request(1, "stats", {})))
    assert isinstance(codec.next_event(), Fatal)  # dead for good: the stream cannot resync


@settings(max_examples=30, deadline=None, database=None)
@given(st.integers(256 * 1024, MAX_FRAME_BYTES))
def test_a_configured_frame_limit_admits_exactly_that_size(limit):
    pad = limit - len(msgpack.packb({"v": 1, "id": 1, "op": "stats", "a": {}, "p": b""}, use_bin_type=True))
    body = {"v": 1, "id": 1, "op": "stats", "a": {}, "p": b"\x00" * pad}
    while len(msgpack.packb(body, use_bin_type=True)) > limit:  # the bin header grew with its length
        body["p"] = body["p"][:-1]
    at_limit = body_frame(body)
    codec = FrameCodec(limit)
    codec.receive_data(at_limit)
    assert isinstance(codec.next_event(), Request)
    over = FrameCodec(len(at_limit) - HEADER.size - 1)
    over.receive_data(at_limit)
    assert isinstance(over.next_event(), Fatal)


def test_the_atheris_harness_runs_clean(tmp_path):
    """A short run of the long fuzzer (fuzz/fuzz_codec.py), so the harness itself cannot rot."""
    pytest.importorskip("atheris", reason="pip install atheris (the long-run fuzzer)")
    harness = os.path.join(REPO, "fuzz", "fuzz_codec.py")
    corpus = str(tmp_path / "corpus")
    subprocess.run([sys.executable, harness, "--write-seeds", corpus], check=True, env=CHILD_ENV, timeout=120)
    # libFuzzer's RSS check reads the peak RSS, which Linux carries across fork and exec: the
    # child starts at this (big, by now) test process's peak, so allow 2 GiB on top of it.
    rss_limit_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + 2048
    proc = subprocess.run([sys.executable, harness, corpus, "-runs=30000", f"-rss_limit_mb={rss_limit_mb}",
                           f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True, env=CHILD_ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = re.search(r"Done (\d+) runs", proc.stderr)  # libFuzzer may overshoot -runs by a few
    assert done is not None and int(done.group(1)) >= 30000, proc.stderr[-2000:]
