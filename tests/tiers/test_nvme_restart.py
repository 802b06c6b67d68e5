"""NVMe tier restarts: clean, after SIGKILL in the middle of a write storm, after damage to
its files, and on a file system that fills up."""

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import xxhash

from kvstore.config import NvmeTierConfig
from kvstore.errors import CapacityError
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.tiers.nvme import NvmeTier

NS = "tenant-a"
DESC = StateDescriptor(NS, "model", "rev1")
MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def oid(i: int) -> ObjectId:
    return ObjectId(hashlib.blake2b(str(i).encode(), digest_size=32).digest())


def payload(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, int(rng.integers(1, 200_000)), dtype=np.uint8)


def put(tier, i):
    data = payload(i)
    return tier.put(NS, oid(i), data, xxhash.xxh3_128_digest(data), DESC)


def storm_config(path, durability="sync"):
    return NvmeTierConfig(path=str(path), capacity_bytes=24 * MIB, file_bytes=4 * MIB, durability=durability, group_commit_ms=3)


def reads_back(tier, i) -> bool | None:
    """True: bit-exact; None: a miss. Anything else is a failed test."""
    data = payload(i)
    out = np.empty(len(data), np.uint8)
    n = tier.get_into(NS, oid(i), out)
    if n is None:
        return None
    assert n == len(data) and (out == data).all(), f"object {i} came back with wrong bytes"
    return True


@pytest.mark.parametrize("durability", ["sync", "group"])
def test_objects_survive_a_clean_restart(tmp_path, durability):
    with NvmeTier(storm_config(tmp_path, durability)) as tier:
        acks = [put(tier, i) for i in range(30)]
        tier.delete(NS, oid(0))
    assert {a.durability for a in acks} == {durability}
    with NvmeTier.open(storm_config(tmp_path, durability)) as tier:
        report = tier.recovery
        assert (report.recovered, report.dropped) == (29, 0) and report.sampled == 29
        assert reads_back(tier, 0) is None
        assert all(reads_back(tier, i) for i in range(1, 30))
        tier.check_integrity()
        assert tier.stats()["objects"] == 29


# -- SIGKILL in the middle of a write storm ------------------------------------------------


def storm(path: str, durability: str, log_path: str, first: int) -> None:
    """Child process: puts (4 in flight) and deletes until killed. Appends one line per step
    to log_path, flushed before the step that follows it: intents `try <i>` and
    `deleting <hex>` before an operation starts, acks `put <i> <durability>` and
    `del <hex>` after it returned, and in group mode `flushed` after each flush()."""
    tier = NvmeTier(storm_config(path, durability))
    live = [m.object_id for m in sorted(tier.list(), key=lambda m: m.created_at)]
    log = open(log_path, "a", buffering=1)
    log.write("ready\n")
    i, window = first, []
    while True:
        while len(window) < 4:
            log.write(f"try {i}\n")
            window.append((i, tier.executor.submit(put, tier, i)))
            i += 1
        j, future = window.pop(0)
        try:
            log.write(f"put {j} {future.result().durability}\n")
            live.append(oid(j))
        except CapacityError:
            pass
        while len(live) > 120:  # keeps the disk about half full, so puts and deletes mix
            victim = live.pop(0)
            log.write(f"deleting {victim.hex}\n")
            tier.delete(NS, victim)
            log.write(f"del {victim.hex}\n")
        if durability == "group" and j % 25 == 0:
            tier.flush()
            log.write("flushed\n")


def run_storm_round(path, durability, log_path, first, rng) -> None:
    code = (
        f"import sys; sys.path[:0] = [{REPO!r}, {os.path.dirname(__file__)!r}]; "
        f"import test_nvme_restart as t; t.storm({str(path)!r}, {durability!r}, {str(log_path)!r}, {first})"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    for _ in range(3000):  # polls every 20 ms: a bound against a child that hangs, not a speed check
        if log_path.exists() and log_path.read_text().startswith("ready\n"):
            break
        assert child.poll() is None, child.stderr.read().decode()
        time.sleep(0.02)
    else:
        child.kill()
        pytest.fail("the storm child never got ready")
    time.sleep(rng.uniform(0.1, 1.0))
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()
    assert child.returncode == -signal.SIGKILL


def expected_state(lines: list[str], present: set[str], group: bool) -> dict[str, str]:
    """hex id -> "present" | "absent" | "maybe", from the objects known present before the
    round and the round's log. An ack is durable at once in sync mode, and in group mode
    once a `flushed` line follows it; an intent without its ack, or an ack not yet durable,
    leaves the object either way."""
    state = dict.fromkeys(present, "present")
    durable_until = len(lines)
    if group:
        durable_until = max((n for n, line in enumerate(lines) if line == "flushed"), default=-1)
    for n, line in enumerate(lines):
        word, *rest = line.split()
        if word == "ready" or word == "flushed":
            continue
        key = oid(int(rest[0])).hex if word in ("try", "put") else rest[0]
        if n > durable_until or word in ("try", "deleting"):
            state[key] = "maybe"
        else:
            state[key] = "present" if word == "put" else "absent"
    return state


@pytest.mark.parametrize("durability", ["sync", "group"])
def test_write_storm_killed_with_sigkill_loses_no_acknowledged_durable_put(tmp_path, durability):
    path = tmp_path / "nvme"
    rng = random.Random(durability)
    present: set[str] = set()
    number = {}  # hex id -> the i its payload comes from
    for round_ in range(3):
        log_path = tmp_path / f"log-{round_}"
        run_storm_round(path, durability, log_path, round_ * 100_000, rng)
        lines = log_path.read_text().split("\n")[:-1]  # a torn last line is no step
        number.update({oid(int(l.split()[1])).hex: int(l.split()[1]) for l in lines if l.startswith("try")})
        state = expected_state(lines, present, durability == "group")
        acked = sum(line.startswith("put") for line in lines)
        assert acked > 0, "the child acknowledged nothing before it was killed"
        with NvmeTier.open(storm_config(path)) as tier:
            tier.check_integrity()
            assert tier.recovery.dropped == 0, tier.recovery
            found = set()
            for meta in list(tier.list()):  # everything stored is bit-exact, or a miss
                assert state.get(meta.object_id.hex) in ("present", "maybe"), "a deleted or unknown object came back"
                if reads_back(tier, number[meta.object_id.hex]):
                    found.add(meta.object_id.hex)
            missing = {h for h, what in state.items() if what == "present"} - found
            assert not missing, f"{len(missing)} objects acknowledged as durable are gone"
            assert tier.stats()["num_checksum_failures"] == 0
            tier.check_integrity()
        present = found


# -- damage found at open ------------------------------------------------------------------


def fill(path, n, size=MIB - 4096, durability="sync"):
    """n objects of about 1 MiB: four to a 4 MiB data file."""
    with NvmeTier(storm_config(path, durability)) as tier:
        for i in range(n):
            data = np.full(size, i + 1, np.uint8)
            tier.put(NS, oid(i), data, xxhash.xxh3_128_digest(data), DESC)
        return {i: tier.meta(NS, oid(i)).file for i in range(n)}


@pytest.mark.parametrize("chunk_records, group_records", [(1, 1), (3, 5), (1 << 20, 1 << 20)])
def test_restart_in_chunks_rebuilds_every_files_extents(tmp_path, monkeypatch, chunk_records, group_records):
    """Restart checks the index a chunk at a time and groups the chunks' extents by file;
    ids are hashes, so a chunk mixes files in any order (here: 18 objects in five files,
    some deleted)."""
    monkeypatch.setattr("kvstore.tiers.nvme.recovery.CHUNK_RECORDS", chunk_records)
    monkeypatch.setattr("kvstore.tiers.nvme.recovery.GROUP_RECORDS", group_records)
    files = fill(tmp_path, 18, size=MIB - 3 * 4096)
    with NvmeTier.open(storm_config(tmp_path)) as tier:
        for i in (0, 5, 17):
            tier.delete(NS, oid(i))
    with NvmeTier.open(storm_config(tmp_path)) as tier:
        assert (tier.recovery.recovered, tier.recovery.dropped) == (15, 0) and len(set(files.values())) == 5
        assert tier.stats()["used_bytes"] == 15 * (MIB - 3 * 4096)
        assert [i for i in files if tier.contains(NS, oid(i))] == [i for i in files if i not in (0, 5, 17)]
        tier.check_integrity()  # the allocators hold exactly the index's extents


def test_startup_sample_stays_at_sample_objects_over_many_chunks(tmp_path, monkeypatch):
    """`sample.items += [... sample.pick(m) ...]` extended the list pick() had just replaced
    (the left side is read first), so each chunk added its picks to the whole old sample:
    178 objects sampled at 10 M records instead of 64."""
    monkeypatch.setattr("kvstore.tiers.nvme.recovery.CHUNK_RECORDS", 2)
    monkeypatch.setattr("kvstore.tiers.nvme.recovery.SAMPLE_OBJECTS", 3)
    fill(tmp_path, 12)
    with NvmeTier.open(storm_config(tmp_path)) as tier:
        assert (tier.recovery.recovered, tier.recovery.sampled) == (12, 3)


def test_missing_data_file_drops_its_objects_at_open(tmp_path):
    files = fill(tmp_path, 12)
    os.unlink(tmp_path / "data-00001.kvs")
    with NvmeTier.open(storm_config(tmp_path)) as tier:
        lost = [i for i, f in files.items() if f == 1]
        assert tier.recovery.dropped_by_reason == {"missing_file": len(lost)} and len(lost) == 4
        assert [i for i in files if tier.contains(NS, oid(i))] == [i for i in files if i not in lost]
        tier.check_integrity()


def test_lower_capacity_drops_objects_in_files_it_no_longer_has(tmp_path):
    files = fill(tmp_path, 12)
    smaller = NvmeTierConfig(path=str(tmp_path), capacity_bytes=8 * MIB, file_bytes=4 * MIB)
    with NvmeTier.open(smaller) as tier:
        assert tier.recovery.dropped == sum(f >= 2 for f in files.values()) == 4
        assert tier.recovery.recovered == 8
        tier.check_integrity()


def test_zeroed_data_file_is_caught_by_the_startup_sample(tmp_path):
    files = fill(tmp_path, 8)
    with open(tmp_path / "data-00000.kvs", "r+b") as f:
        f.write(bytes(4 * MIB))
    with NvmeTier.open(storm_config(tmp_path)) as tier:
        assert tier.recovery.dropped_by_reason == {"checksum": 4}
        assert sorted(i for i in files if tier.contains(NS, oid(i))) == [4, 5, 6, 7]
        tier.check_integrity()


def test_broken_and_overlapping_index_entries_are_dropped_at_open(tmp_path):
    from kvstore.tiers.nvme.index import NvmeIndex, object_key

    fill(tmp_path, 4)
    index = NvmeIndex(str(tmp_path / "index"))
    index.put(object_key(NS, oid(99)), index.get(object_key(NS, oid(2))), sync=True)  # shares 2's extent
    index.put(object_key(NS, oid(98)), b"not msgpack", sync=True)
    index.put(b"\x00\x03abc-too-short", index.get(object_key(NS, oid(3))), sync=True)
    index.close()
    with NvmeTier.open(storm_config(tmp_path)) as tier:
        assert tier.recovery.dropped_by_reason == {"overlap": 2, "bad_record": 1, "bad_key": 1}
        assert [i for i in (0, 1, 2, 3, 99) if tier.contains(NS, oid(i))] == [0, 1, 3]
        tier.check_integrity()
    with NvmeTier.open(storm_config(tmp_path)) as tier:
        assert tier.recovery.dropped == 0 and tier.recovery.recovered == 3


# -- a file system that fills up -----------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (root only)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("needs root and mount -t tmpfs; test_nvme.py covers a full tier without it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_preallocating_more_than_the_file_system_holds_is_a_capacity_error(small_fs):
    with pytest.raises(CapacityError, match=f"{small_fs}/nvme/data-0000.\\.kvs to 4194304 bytes: no space"):
        NvmeTier(NvmeTierConfig(path=str(small_fs / "nvme"), capacity_bytes=16 * MIB, file_bytes=4 * MIB))
    assert not [n for n in os.listdir(small_fs / "nvme") if n.startswith("data-")]  # nothing left behind


def test_full_file_system_fails_the_put_cleanly_and_the_tier_keeps_serving(small_fs):
    cfg = NvmeTierConfig(path=str(small_fs / "nvme"), capacity_bytes=4 * MIB, file_bytes=2 * MIB)
    with NvmeTier(cfg) as tier:
        acked = [i for i in range(5) if put(tier, i)]
        with open(small_fs / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(bytes(64 * 1024))
                    filler.flush()
            except OSError:
                pass
        with pytest.raises(CapacityError, match=f"{small_fs}/nvme/index.*no space"):
            for i in range(5, 400):  # data extents are preallocated; the index append fails
                put(tier, i)
                acked.append(i)
        failed = i
        with pytest.raises(CapacityError):
            put(tier, 1000)
        assert all(reads_back(tier, i) for i in acked)  # still serving
        assert tier.stats()["index_failed"]
        tier.check_integrity()
    os.unlink(small_fs / "filler")
    with NvmeTier.open(cfg) as tier:
        assert all(reads_back(tier, i) for i in acked)
        assert reads_back(tier, failed) is None
        tier.check_integrity()
        assert put(tier, failed).durability == "sync"
