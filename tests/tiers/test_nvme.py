"""NVMe tier on real files and a real RocksDB index (tmp_path is on the machine's disk, so
O_DIRECT is exercised; the tmpfs tests in test_nvme_restart.py cover the buffered fallback)."""

import errno
import logging
import mmap
import os
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xxhash

from kvstore.config import NvmeTierConfig
from kvstore.errors import CapacityError, ChecksumError, Conflict, InvalidArgument, ServiceError
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.tiers.nvme import VERIFY_BLOCK_BYTES, NvmeTier
from kvs_testing import payload

NS = "tenant-a"
DESC = StateDescriptor(NS, "model", "rev1")
MIB = 1 << 20


def oid(i: int) -> ObjectId:
    return ObjectId(i.to_bytes(32, "big"))


def put(tier, i, size, **kw):
    data = payload(size, i)
    return tier.put(NS, oid(i), data, xxhash.xxh3_128_digest(data), DESC, **kw), data


def config(tmp_path, **kw):
    kw = {"capacity_bytes": 8 * MIB, "file_bytes": 2 * MIB, **kw}
    return NvmeTierConfig(path=str(tmp_path / "nvme"), **kw)


@pytest.fixture
def tier(tmp_path):
    with NvmeTier(config(tmp_path)) as t:
        yield t
        t.check_integrity()


def aligned(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(size, 1)))


SIZES = [1, 4095, 4096, 4097, VERIFY_BLOCK_BYTES, VERIFY_BLOCK_BYTES + 1, 300_001, 2 * MIB - 4096]


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_is_bit_exact_for_aligned_and_unaligned_buffers(tier, size):
    src = aligned(size)
    src[:size] = payload(size, size).tobytes()
    for i, data in enumerate([payload(size, size), src[:size]]):  # unaligned ndarray, aligned mmap
        result = tier.put(NS, oid(i), data, xxhash.xxh3_128_digest(data), DESC)
        assert result.durability == "sync" and result.size == size and result.extent.offset % 4096 == 0
        for out in (np.empty(size + 3, np.uint8)[3:], aligned(size + 4096)):
            assert tier.get_into(NS, oid(i), out) == size
            assert bytes(out[:size]) == bytes(data)
    assert tier.stats()["hits"] == 4 and tier.stats()["num_checksum_failures"] == 0


@pytest.mark.parametrize("size", [5000, 3 * VERIFY_BLOCK_BYTES + 17])
def test_read_range_returns_exactly_the_range(tier, size):
    _, data = put(tier, 1, size)
    rng = random.Random(size)
    ranges = [(0, 1), (size - 1, 1), (0, size), (VERIFY_BLOCK_BYTES - 3, 7)]
    ranges += [(o, rng.randrange(1, size - o + 1)) for o in (rng.randrange(size) for _ in range(20))]
    for offset, length in ranges:
        if offset + length > size:
            continue
        out = np.full(length + 5, 7, np.uint8)
        assert tier.read_range(NS, oid(1), offset, length, out) == length
        assert (out[:length] == data[offset : offset + length]).all() and (out[length:] == 7).all()
    with pytest.raises(InvalidArgument):
        tier.read_range(NS, oid(1), size - 1, 2, np.empty(2, np.uint8))


def test_meta_list_contains_and_hints_round_trip(tier):
    put(tier, 1, 100, hints=Hints(priority=3, session_id="s"))
    put(tier, 2, 200)
    other = StateDescriptor("tenant-b", "model", "rev1")
    tier.put("tenant-b", oid(1), b"x", xxhash.xxh3_128_digest(b"x"), other)
    meta = tier.meta(NS, oid(1))
    assert (meta.size, meta.descriptor, meta.hints.priority, meta.durability) == (100, DESC, 3, "sync")
    assert tier.contains(NS, oid(2)) and not tier.contains(NS, oid(3)) and tier.meta(NS, oid(3)) is None
    assert sorted(m.object_id for m in tier.list(NS)) == [oid(1), oid(2)]
    assert [m.namespace for m in tier.list("tenant-b")] == ["tenant-b"]
    assert len(list(tier.list())) == 3


def test_put_of_a_stored_id_is_deduplicated(tier):
    first, _ = put(tier, 1, 10_000)
    again, _ = put(tier, 1, 10_000)
    assert again.deduplicated and again.extent == first.extent
    assert tier.stats()["objects"] == 1 and tier.stats()["num_dedup_puts"] == 1


def test_put_of_a_stored_id_with_other_bytes_is_a_conflict_not_a_dedup(tier):
    """A put must never be answered with a record of other bytes (a copy of a deleted object
    whose removal had not run yet, say): it would be served under the new checksum's name."""
    put(tier, 1, 10_000)
    other = np.full(10_000, 7, np.uint8)
    with pytest.raises(Conflict, match="other bytes"):
        tier.put(NS, oid(1), other, xxhash.xxh3_128_digest(other), DESC)
    assert tier.stats()["num_dedup_puts"] == 0
    tier.check_integrity()


def test_put_whose_bytes_do_not_match_the_checksum_stores_nothing(tier):
    with pytest.raises(ChecksumError):
        tier.put(NS, oid(1), payload(5000, 1), b"\0" * 16, DESC)
    assert not tier.contains(NS, oid(1)) and tier.stats()["used_bytes"] == 0


@pytest.mark.parametrize(
    "bad",
    [dict(capacity_bytes=1000), dict(file_bytes=0), dict(durability="async"), dict(group_commit_ms=0),
     dict(io_threads=0), dict(io_threads=1000), dict(capacity_bytes=True)],
)
def test_config_rejects_bad_values(tmp_path, bad):
    with pytest.raises(InvalidArgument):
        config(tmp_path, **bad)


def test_tier_without_a_path_is_refused():
    """The `[nvme]` table's empty path means <data_dir>/nvme: the daemon fills it in, the tier never guesses."""
    with pytest.raises(InvalidArgument, match="nvme.path"):
        NvmeTier(NvmeTierConfig())


def test_reopen_with_another_file_size_is_refused(tmp_path):
    NvmeTier(config(tmp_path)).close()
    with pytest.raises(InvalidArgument, match="file_bytes"):
        NvmeTier(config(tmp_path, file_bytes=4 * MIB))


def test_second_tier_on_the_same_directory_is_refused(tier, tmp_path):
    with pytest.raises(ServiceError, match="another daemon"):
        NvmeTier(config(tmp_path))


def test_full_tier_raises_capacity_error_keeps_serving_and_delete_frees_space(tier, tmp_path):
    stored = []
    with pytest.raises(CapacityError, match=f"{tmp_path}.*no free extent"):
        for i in range(100):
            stored.append(put(tier, i, MIB - 100)[1])  # 1 MiB extents, 2 per file, 8 in all
    assert len(stored) == 8 and tier.stats()["used_bytes"] == tier.stats()["capacity_bytes"]
    out = np.empty(MIB, np.uint8)
    assert tier.get_into(NS, oid(3), out) == MIB - 100 and (out[: MIB - 100] == stored[3]).all()
    extent = tier.meta(NS, oid(3)).extent
    assert tier.delete(NS, oid(3)) and not tier.delete(NS, oid(3))
    tier.check_integrity()
    result, _ = put(tier, 50, MIB - 100)
    assert result.extent == extent  # the freed extent was reused
    with pytest.raises(CapacityError, match="raise file_bytes"):
        put(tier, 99, 3 * MIB)


def test_flipped_byte_is_a_miss_and_a_counter_never_wrong_data(tier, caplog):
    put(tier, 1, 200_000)
    put(tier, 2, 200_000)
    meta = tier.meta(NS, oid(1))
    flip(tier, meta, 150_000)
    out = np.empty(200_000, np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.nvme"):
        assert tier.get_into(NS, oid(1), out) is None
    assert (out == 0).all()
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "checksum" in caplog.text
    stats = tier.stats()
    assert (stats["num_checksum_failures"], stats["misses"], stats["objects"]) == (1, 1, 1)
    assert not tier.contains(NS, oid(1))  # dropped
    assert tier.get_into(NS, oid(2), out) == 200_000  # the neighbour is untouched


def test_ranged_read_checks_the_blocks_it_reads(tier):
    _, data = put(tier, 1, 4 * VERIFY_BLOCK_BYTES)
    flip(tier, tier.meta(NS, oid(1)), 3 * VERIFY_BLOCK_BYTES + 10)
    out = np.empty(100, np.uint8)
    assert tier.read_range(NS, oid(1), 0, 100, out) == 100  # block 0 is intact
    assert (out == data[:100]).all()
    assert tier.read_range(NS, oid(1), 3 * VERIFY_BLOCK_BYTES, 100, out) is None
    assert tier.stats()["num_checksum_failures"] == 1 and not tier.contains(NS, oid(1))


def flip(tier, meta, at):
    path = os.path.join(tier.config.path, f"data-{meta.file:05d}.kvs")
    with open(path, "r+b") as f:
        f.seek(meta.extent.offset + at)
        byte = f.read(1)
        f.seek(meta.extent.offset + at)
        f.write(bytes([byte[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


def test_disk_error_on_write_is_a_service_error_and_changes_nothing(tier, monkeypatch):
    put(tier, 1, 5000)

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev", eio)
    with pytest.raises(ServiceError, match="Errno 5"):
        put(tier, 2, 5000)
    monkeypatch.undo()
    assert not tier.contains(NS, oid(2)) and tier.stats()["num_io_errors"] == 1
    tier.check_integrity()
    put(tier, 2, 5000)  # still usable
    assert tier.stats()["objects"] == 2


def test_failed_data_sync_fails_the_put_and_the_next_put_succeeds(tier, monkeypatch):
    put(tier, 1, 5000)
    real = os.fdatasync
    calls = []

    def eio_once(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fdatasync", eio_once)
    with pytest.raises(ServiceError, match="Errno 5"):
        put(tier, 2, 5000)
    assert not tier.contains(NS, oid(2)) and tier.stats()["objects"] == 1
    tier.check_integrity()
    assert put(tier, 2, 5000)[0].durability == "sync" and tier.contains(NS, oid(2))
    tier.check_integrity()


def test_file_system_refusing_o_direct_gets_buffered_io_and_one_warning(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def open_without_direct(path, flags, *args):  # what tmpfs answered before Linux 6.6
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.nvme"), NvmeTier(config(tmp_path)) as tier:
        assert not tier.stats()["direct_io"]
        _, data = put(tier, 1, 10_000)
        out = np.empty(10_000, np.uint8)
        assert tier.get_into(NS, oid(1), out) == 10_000 and (out == data).all()
    assert [r.message for r in caplog.records if "nvme_buffered_io" in r.message] == [
        f"event=nvme_buffered_io path={tmp_path / 'nvme'} reason=o_direct_refused"
    ]


def test_extent_under_a_read_is_not_reused_until_the_read_ends(tier):
    put(tier, 1, 5000)
    record = tier._begin_read(tier_key(1))  # a read in flight
    assert tier.delete(NS, oid(1))
    result, _ = put(tier, 2, 5000)
    assert result.extent.offset != record.offset
    tier.check_integrity()
    tier._end_read(record)
    tier.check_integrity()
    assert put(tier, 3, 5000)[0].extent.offset == record.offset


def tier_key(i):
    from kvstore.tiers.nvme.index import object_key

    return object_key(NS, oid(i))


def test_group_durability_acknowledges_group_and_commits(tmp_path):
    with NvmeTier(config(tmp_path, durability="group", group_commit_ms=1000)) as tier:
        result, data = put(tier, 1, 70_000)
        assert result.durability == "group" and tier.meta(NS, oid(1)).durability == "group"
        out = np.empty(70_000, np.uint8)
        assert tier.get_into(NS, oid(1), out) == 70_000 and (out == data).all()
        tier.flush()
        assert tier.meta(NS, oid(1)).durability == "sync" and tier.stats()["num_pending_commit"] == 0
        put(tier, 2, 100)
        assert tier.delete(NS, oid(1)) and tier.stats()["used_bytes"] > 4096  # freed on commit
        tier.check_integrity()
        tier.flush()
        assert tier.stats()["used_bytes"] == 4096
        tier.check_integrity()


def test_group_delete_frees_space_for_a_full_tier(tmp_path):
    with NvmeTier(config(tmp_path, durability="group", group_commit_ms=10_000)) as tier:
        for i in range(8):
            put(tier, i, MIB)
        assert tier.delete(NS, oid(0))
        assert put(tier, 8, MIB)[0].size == MIB  # the put forced the commit that frees oid(0)
        tier.check_integrity()


@pytest.mark.parametrize("durability", ["sync", "group"])
def test_concurrent_puts_gets_and_deletes_keep_every_object_readable(tmp_path, durability):
    cfg = config(tmp_path, capacity_bytes=16 * MIB, durability=durability, group_commit_ms=2)
    def work(seed):
        rng = random.Random(seed)
        for step in range(60):
            i = rng.randrange(40)
            action = rng.random()
            if action < 0.5:
                try:
                    put(tier, i, 1 + (i * 7919) % 150_000)
                except CapacityError:
                    continue
            elif action < 0.8:
                out = np.empty(150_000, np.uint8)
                n = tier.get_into(NS, oid(i), out)
                if n is not None:
                    assert (out[:n] == payload(1 + (i * 7919) % 150_000, i)).all()
            else:
                tier.delete(NS, oid(i))

    with NvmeTier(cfg) as tier:
        futures = [tier.executor.submit(work, s) for s in range(4)]
        checker = ThreadPoolExecutor(1).submit(lambda: [tier.check_integrity() for _ in range(5)])
        for f in futures:
            f.result()
        checker.result()
        tier.check_integrity()
        assert tier.stats()["num_checksum_failures"] == 0
        stored = {m.object_id for m in tier.list()}
    with NvmeTier(cfg) as tier:
        assert {m.object_id for m in tier.list()} == stored
        tier.check_integrity()
