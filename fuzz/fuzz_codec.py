"""Coverage-guided fuzzing of the frame codec and typed-message decoding (atheris/libFuzzer).

The long-run twin of tests/hardening/test_fuzz_codec.py. Each input is one of:

    mode 0  a byte stream fed to a FrameCodec in fuzzer-chosen pieces; every Request that
            comes out is decoded into its typed message
    mode 1  a msgpack body decoded as the args of a fuzzer-chosen op
    mode 2  one field of a valid message replaced by a msgpack value from the input
    mode 3  one field of a valid reserve's descriptor replaced by a string from the input
            (or a layout parameter's value: where unicode digits once raised ValueError)

The properties checked (anything else raised is a finding, and libFuzzer saves the input):
the codec yields only typed events and never raises; a Fatal stays fatal; decoding raises
nothing but a RequestError.

    pip install atheris                      # a wheel for CPython 3.11 on x86-64 Linux
    python fuzz/fuzz_codec.py --write-seeds fuzz/corpus
    python fuzz/fuzz_codec.py fuzz/corpus -max_total_time=3600 -rss_limit_mb=2048 -jobs=2

A finding is saved as ./crash-<sha1>; replay it with `python fuzz/fuzz_codec.py crash-<sha1>`.
"""

from __future__ import annotations

import os
import sys

import atheris

with atheris.instrument_imports():
    import msgpack

    from kvstore import messages as m
    from kvstore.errors import RequestError
    from kvstore.protocol import NEED_DATA, BadFrame, Fatal, FrameCodec, Reply, Request

OPS = sorted(m.OPS)
# One valid instance of every op: the seeds, and what mode 2 makes hostile.
_ID = b"\x01" * 32
_DESC = {"namespace": "t", "model": "m", "model_revision": "r", "kind": "kv", "dtype": "bf16",
         "layout": "paged(order=layer_first,layers=2,block=16,kv_heads=1,head_dim=8)", "shard": "0/1",
         "chunk_tokens": 16}
VALID = {
    "hello": {"client": "fuzz", "pid": 1}, "open": {"namespace": "t", "token": "secret-secret-secret"},
    "reserve": {"namespace": "t", "object_id": _ID, "size": 2048, "descriptor": _DESC, "hints": {"ttl_s": 1.0}},
    "put_inline": {"namespace": "t", "object_id": _ID, "descriptor": _DESC, "data": b"x" * 2048, "hints": {"ttl_s": 1.0}},
    "abort": {"lease": 1},
    "get": {"namespace": "t", "object_id": _ID, "accept": ["bf16"]}, "release": {"lease": 1},
    "lookup": {"namespace": "t", "ids": [_ID]}, "delete": {"namespace": "t", "ids": [_ID]},
    "pin": {"namespace": "t", "ids": [_ID], "ttl_s": 2.0}, "unpin": {"namespace": "t", "ids": [_ID]},
    "prefetch": {"namespace": "t", "ids": [_ID], "tier": "host", "policy": "wait", "timeout_s": 0.1},
    "stats": {}, "check": {}, "gpu_handle": {},
    "reserve_many": {"namespace": "t", "ids": _ID * 2, "sizes": (2048).to_bytes(8, "little") * 2, "descriptor": _DESC},
    "commit_many": {"leases": (1).to_bytes(8, "little"), "checksums": b"\x00" * 16},
    "get_many": {"namespace": "t", "ids": _ID * 3, "expect": _DESC},
    "release_many": {"leases": (1).to_bytes(8, "little") * 2}, "touch": {"namespace": "t", "ids": [_ID]},
    "commit_group": {"manifest": 1, "members": _ID + b"\x02" * 32, "leases": (2).to_bytes(8, "little") + bytes(8),
                     "checksums": b"\x00" * 32},
    "lookup_groups": {"namespace": "t", "members": _ID + b"\x02" * 32, "counts": (1).to_bytes(8, "little") * 2,
                      "expect": [_DESC]},
    "get_group": {"namespace": "t", "members": _ID + b"\x02" * 32, "expect": [_DESC], "expect_of": b"\x00\xff"},
}


def _decode(op: str, args: dict) -> None:
    try:
        m.decode_request(Request(1, op, args))
    except RequestError:
        pass


def _stream(fdp: atheris.FuzzedDataProvider) -> None:
    codec = FrameCodec(fdp.ConsumeIntInRange(1, 1 << 16))
    dead = False
    while fdp.remaining_bytes():
        codec.receive_data(fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 512)))
        while (event := codec.next_event()) is not NEED_DATA:
            if isinstance(event, Fatal):
                dead = True
                break
            assert not dead, "an event after Fatal"
            assert isinstance(event, (Request, Reply, BadFrame)), event
            if isinstance(event, Request):
                _decode(event.op, event.args)
        if dead:
            codec.receive_data(FrameCodec().send_request(Request(1, "stats", {})))
            assert isinstance(codec.next_event(), Fatal), "a Fatal codec came back to life"
            return


def _unpack(data: bytes):
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception:
        return None


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 3)
    if mode == 3:
        _descriptor(fdp)
        return
    if mode == 0:
        _stream(fdp)
        return
    op = OPS[fdp.ConsumeIntInRange(0, len(OPS) - 1)]
    if mode == 1:
        args = _unpack(fdp.ConsumeBytes(fdp.remaining_bytes()))
        if isinstance(args, dict) and all(isinstance(k, str) for k in args):
            _decode(op, args)
        return
    args = dict(VALID[op])
    field = fdp.ConsumeUnicodeNoSurrogates(12) if fdp.ConsumeBool() or not args else sorted(args)[
        fdp.ConsumeIntInRange(0, len(args) - 1)]
    args[field] = _unpack(fdp.ConsumeBytes(fdp.remaining_bytes()))
    _decode(op, args)


# Characters the descriptor parsers must classify: ASCII syntax and digits, and look-alikes
# that str methods call digits or spaces (superscripts, other scripts' digits, fractions).
ALPHABET = "0123456789-+_=,()/ .eEabkvlayersblockorder" + "²³¹⁰₀٣٠१৪௧๕໒༣၅០᠐𝟙①½Ⅻ\u00a0\u2007\u3000"


def _text(fdp: atheris.FuzzedDataProvider) -> str:
    if fdp.ConsumeBool():
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 300))
    return "".join(ALPHABET[b % len(ALPHABET)] for b in fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40)))


def _descriptor(fdp: atheris.FuzzedDataProvider) -> None:
    desc = dict(_DESC)
    field = sorted(desc)[fdp.ConsumeIntInRange(0, len(desc) - 1)]
    text = _text(fdp)
    if fdp.ConsumeBool():
        param = ("order", "layers", "block", "kv_heads", "head_dim")[fdp.ConsumeIntInRange(0, 4)]
        desc["layout"] = desc["layout"].replace(f"{param}=", f"{param}={text}", 1)
    elif field == "chunk_tokens":
        desc[field] = fdp.ConsumeInt(8)
    else:
        desc[field] = text
    _decode("reserve", {**VALID["reserve"], "descriptor": desc})


def write_seeds(directory: str) -> None:
    """Valid frames of every op, plus a few classic bad ones, as a starting corpus."""
    os.makedirs(directory, exist_ok=True)
    codec = FrameCodec()
    for i, op in enumerate(OPS):
        frame = codec.send_request(Request(i + 1, op, VALID[op]))
        with open(os.path.join(directory, f"seed-{op}"), "wb") as f:
            f.write(b"\x00" + frame)  # mode 0 (first byte), then the stream
        with open(os.path.join(directory, f"seed-args-{op}"), "wb") as f:
            f.write(bytes([1, i]) + msgpack.packb(VALID[op], use_bin_type=True))
    with open(os.path.join(directory, "seed-huge-length"), "wb") as f:
        f.write(b"\x00" + (2**31).to_bytes(4, "little") + b"x")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        write_seeds(sys.argv[2])
        return
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
