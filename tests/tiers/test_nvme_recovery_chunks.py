"""Restart checks records a chunk at a time with numpy (tiers/nvme/recovery.py): the verdict
on every record must be the one a record-at-a-time check gives, and the startup sample must
stay uniform."""

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from kvstore.identity import ID_BYTES, ObjectId
from kvstore.tiers.nvme.files import ALIGN
from kvstore.tiers.nvme.holdings import lengths_of
from kvstore.tiers.nvme.index import EXTENT_HEAD, META_KEY, NvmeRecord, decode_extent, object_key, well_formed_heads
from kvstore.tiers.nvme.recovery import _check_chunk, _ExtentsByFile, _Reservoir, file_limits

FILE_BYTES = 1 << 20
FILES = [SimpleNamespace(index=0, size_bytes=FILE_BYTES, created=False),
         SimpleNamespace(index=1, size_bytes=FILE_BYTES, created=True),  # new: its data is gone
         SimpleNamespace(index=2, size_bytes=FILE_BYTES // 2, created=False)]
DESC = {"namespace": "ns", "model": "m", "model_revision": "r"}


def one_at_a_time(key: bytes, value: bytes):
    """The checks of one record, as restart made them before it worked in chunks."""
    if len(key) != 2 + int.from_bytes(key[:2], "big") + ID_BYTES or key[:2] == b"\0\0":
        return None if key == META_KEY else "bad_key"
    head = decode_extent(value)
    if head is None:
        return "bad_record"
    file, offset, size = head
    length = (size + ALIGN - 1) & -ALIGN
    if file >= len(FILES) or FILES[file].created:
        return "missing_file"
    if offset % ALIGN or size <= 0 or offset + length > FILES[file].size_bytes:
        return "outside_file"
    return (file, offset, length, size)


def pick(rng, options: list[int]) -> int:
    return options[int(rng.integers(0, len(options)))]  # exact: numpy would turn 2**64 - 1 into a float


def records(rng, n):
    for i in range(n):
        key = object_key("ns", ObjectId(rng.bytes(32)))
        file = pick(rng, [0, 0, 1, 2, 3, 2**32 - 1])
        offset = pick(rng, [0, ALIGN * 7, ALIGN * 200, 3, FILE_BYTES - ALIGN, 2**63, 2**64 - 1])
        size = pick(rng, [1, 1000, ALIGN, ALIGN + 1, FILE_BYTES, 0, 2**64 - 1])
        value = NvmeRecord(file, offset, size, bytes(16), None, DESC, {}, 0.0).encode()
        spoil = rng.integers(0, 10)
        if spoil == 0:
            value = value[:int(rng.integers(0, 41))]  # truncated head
        elif spoil == 1:
            at = int(rng.integers(0, 41))
            value = value[:at] + bytes([value[at] ^ 0x5A]) + value[at + 1:]  # one byte of the head changed
        elif spoil == 2:
            key = key[:int(rng.integers(0, len(key)))]  # truncated key
        elif spoil == 3:
            key = b"\0\0" + key[2:]
        yield key, value
    yield META_KEY, b"\x81\xa1v\x01"


def test_a_head_is_well_formed_exactly_when_decode_extent_reads_it():
    """well_formed_heads compares masked 64-bit words; every byte of the head, changed."""
    value = NvmeRecord(3, 1 << 40, (1 << 64) - 1, bytes(16), None, DESC, {}, 0.0).encode()
    spoiled = [value] + [value[:at] + bytes([value[at] ^ x]) + value[at + 1:]
                         for at in range(EXTENT_HEAD.itemsize) for x in (0x01, 0x80, 0xFF)]
    heads = np.frombuffer(b"".join(v[:EXTENT_HEAD.itemsize] for v in spoiled), EXTENT_HEAD)
    expected = [decode_extent(v) is not None for v in spoiled]
    assert well_formed_heads(heads).tolist() == expected and 0 < sum(expected) < len(expected)


@pytest.mark.parametrize("seed", range(4))
def test_each_records_verdict_matches_the_one_record_check(seed):
    rng = np.random.default_rng(seed)
    keys, values = map(list, zip(*records(rng, 3000)))
    dropped: dict = {}
    good, file, offset, length, size = _check_chunk(keys, values, lengths_of(keys), lengths_of(values),
                                                     file_limits(FILES), dropped)
    why = {key: reason for reason, ks in dropped.items() for key in ks}
    verdicts = Counter()
    for i, (key, value) in enumerate(zip(keys, values)):
        expected = one_at_a_time(key, value)
        if isinstance(expected, tuple):
            assert good[i] and (int(file[i]), int(offset[i]), int(length[i]), int(size[i])) == expected, i
            verdicts["good"] += 1
        else:
            assert not good[i] and why.get(key) == expected, (i, expected, why.get(key))
            verdicts[expected] += 1
    assert set(verdicts) == {"good", "bad_key", "bad_record", "missing_file", "outside_file", None}


def test_the_sample_stays_uniform_across_chunks():
    counts = Counter()
    for trial in range(3000):
        sample = _Reservoir(4)
        seen = 0
        for m in (3, 0, 10, 7):  # chunks of 20 items in all, one empty
            picked = sample.pick(m)
            assert len(set(picked.tolist())) == len(picked)
            sample.items += [seen + int(i) for i in picked]
            seen += m
            assert len(sample.items) == min(4, seen) and len(set(sample.items)) == len(sample.items)
        counts.update(sample.items)
    # each of the 20 items is kept with probability 4/20: 600 of 3,000 trials (sd ~ 22)
    assert set(counts) == set(range(20))
    assert all(480 < c < 720 for c in counts.values()), counts


@pytest.mark.parametrize("group_records", [1, 7, 1 << 20])
def test_extents_come_back_per_file_in_the_order_added(monkeypatch, group_records):
    monkeypatch.setattr("kvstore.tiers.nvme.recovery.GROUP_RECORDS", group_records)
    rng = np.random.default_rng(group_records)
    extents, model = _ExtentsByFile(5), {f: [] for f in range(5)}
    for _ in range(40):
        n = int(rng.integers(0, 9))
        file, offset, size = rng.integers(0, 4, n), rng.integers(0, 1 << 40, n), rng.integers(1, 1 << 20, n)
        extents.add(file, offset, size)
        for f, o, s in zip(file.tolist(), offset.tolist(), size.tolist()):
            model[f].append((o, s))
    assert not model[4]
    for f in (3, 0, 4, 1, 2):
        offsets, sizes = extents.pop(f)
        assert list(zip(offsets.tolist(), sizes.tolist())) == model[f]
