"""What recovery hands the daemon for its index of NVMe objects (tiers/nvme/holdings.py):
every object kept, with its size and age, and nothing recovery dropped."""

import time

import numpy as np
import pytest
import xxhash

from kvstore.config import NvmeTierConfig
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.holdings import Holdings, HoldingsBuilder, created_at_of, split_keys
from kvstore.tiers.nvme.index import NvmeRecord, object_key, split_key

MIB = 1 << 20


def config(path):
    return NvmeTierConfig(path=str(path), capacity_bytes=24 * MIB, file_bytes=4 * MIB)


def oid(i: int) -> ObjectId:
    return ObjectId(xxhash.xxh3_128_digest(str(i).encode()) * 2)


def put(tier, namespace: str, i: int, size: int) -> None:
    data = np.full(size, i % 251, np.uint8)
    tier.put(namespace, oid(i), data, xxhash.xxh3_128_digest(data), StateDescriptor(namespace, "m", "r"))


def test_holdings_name_every_object_kept_with_its_size_oldest_first(tmp_path):
    with NvmeTier(config(tmp_path)) as tier:
        for i in range(12):  # four to a 4 MiB file; written in order, so i is the age order
            put(tier, "a", i, MIB - 4096 * (1 + i % 3))
            time.sleep(0.002)
        tier.delete("a", oid(3))
        metas = {m.object_id: m for m in tier.list()}
    with open(tmp_path / "data-00001.kvs", "r+b") as f:  # objects 4-7: the startup sample drops them
        f.write(bytes(4 * MIB))
    with NvmeTier.open(config(tmp_path)) as tier:
        assert tier.recovery.dropped_by_reason == {"checksum": 4}
        keys, sizes = tier.take_holdings().by_age()
        kept = [i for i in range(12) if i != 3 and not 4 <= i <= 7]
        assert keys == [object_key("a", oid(i)) for i in kept]  # oldest first
        assert sizes == [metas[oid(i)].size for i in kept]
        assert all(type(key) is bytes for key in keys)
        with pytest.raises(RuntimeError, match="taken already"):
            tier.take_holdings()


def test_holdings_of_several_namespaces_keep_each_objects_own(tmp_path):
    with NvmeTier(config(tmp_path)) as tier:
        for i in range(6):
            put(tier, ("a", "bb", "a-longer-name")[i % 3], i, 8192 * (i + 1))
            time.sleep(0.002)
    with NvmeTier.open(config(tmp_path)) as tier:
        keys, sizes = tier.take_holdings().by_age()
    assert keys == [object_key(("a", "bb", "a-longer-name")[i % 3], oid(i)) for i in range(6)]
    assert [split_key(key) for key in keys] == [(("a", "bb", "a-longer-name")[i % 3], oid(i)) for i in range(6)]
    assert sizes == [8192 * (i + 1) for i in range(6)]


def test_created_at_is_read_from_a_records_tail_and_zero_where_it_is_not_one():
    records = [NvmeRecord(0, 0, 10, bytes(16), None, {}, {}, t).encode() for t in (0.5, 1764790000.25, 3e9)]
    records.append(records[0][:-9] + b"\xca" + bytes(8))  # a float32 marker: not one we write
    assert created_at_of(records).tolist() == [0.5, 1764790000.25, 3e9, 0.0]
    assert created_at_of([records[2]]).tolist() == [3e9]
    assert created_at_of([b"\xcb" + bytes(3)]).tolist() == [0.0]  # shorter than a float's tail
    assert len(created_at_of([])) == 0


def test_by_age_breaks_ties_in_index_order_and_handles_nothing():
    keys = [object_key("n", oid(i)) for i in range(4)]
    numbers, ids = split_keys(keys, {})
    held = Holdings([keys[0][:-32]], [numbers[:1], numbers[1:]], [ids[:1], ids[1:]], np.array([1, 2, 3, 4], np.int64),
                    np.array([5.0, 1.0, 5.0, 1.0]))
    assert held.by_age() == ([keys[i] for i in (1, 3, 0, 2)], [2, 4, 1, 3])
    assert held.age_order().tolist() == [1, 3, 0, 2]
    assert HoldingsBuilder().build(set()).by_age() == ([], [])


def test_age_order_ranks_times_across_their_whole_span():
    rng = np.random.default_rng(3)
    times = np.concatenate([rng.uniform(1.7e9, 1.8e9, 5000), [0.0, 0.0, 1.8e9 + 1]])  # unreadable times: oldest
    held = Holdings([b"\x00\x01n"], [np.zeros(len(times), np.uint16)], [np.zeros((len(times), 32), np.uint8)],
                    np.ones(len(times), np.int64), times)
    order = held.age_order()
    assert order.tolist() == np.argsort(times, kind="stable").tolist()


def test_split_keys_numbers_each_prefix_once_across_lengths_and_calls():
    names = ["a", "bb", "a", "ccc", "dd", "bb"]
    keys = [object_key(name, oid(i)) for i, name in enumerate(names)]
    prefixes: dict[bytes, int] = {}
    numbers, ids = split_keys(keys, prefixes)
    assert [list(prefixes)[n] for n in numbers.tolist()] == [k[:-32] for k in keys]
    assert [bytes(row) for row in ids] == [oid(i).digest for i in range(6)]
    again, _ = split_keys([object_key("dd", oid(9)), object_key("e", oid(9))], prefixes)
    assert again.tolist() == [numbers[4], len(prefixes) - 1] and len(prefixes) == 5
    assert [len(x) for x in split_keys([], prefixes)] == [0, 0]
